"""Megatron-Core dist-checkpointing (``torch_dist``): engine=megatron's checkpoint IO.

:class:`MegatronCheckpointIO` writes and reads ``<step dir>/megatron``; the step directory's
atomic protocol (``step_N.tmp`` -> ``complete`` -> rename -> ``latest``) and the RNG-state files
are :class:`launcher.runtime.checkpoint.CheckpointManager`'s, the same for every engine.

The model is saved as a sharded state dict in model space: tensors are addressed by global name
and global slice, not by rank, so a checkpoint written with one TP/PP/DP layout loads into
another. The optimizer follows the same idea:

* plain optimizer (``parallelism.zero_stage=0``): Megatron-Core's model-space optimizer state;
* distributed optimizer (``zero_stage=1``): ``engine.optimizer_checkpoint``, Megatron-Core's
  ``distrib_optim_sharding_type``. ``dp_reshardable`` (the default, as Megatron-LM's): each rank
  writes its flat ZeRO-1 shard as it holds it, so a save runs at disk speed; a resume may change
  DP only, and :mod:`launcher.convert.reshard` rewrites such a checkpoint once for any other
  layout. ``fully_reshardable``: on save Megatron-Core gathers the flat shards over the
  data-parallel group and reshapes them to parameter shape (about 4x slower on CPU); on load
  every rank reads what its new shard needs, so TP, PP and DP may all change.
  (``fully_sharded_model_space`` is deprecated and rejects the flattened shards in 0.16.1.)

The checkpoint records its layout and optimizer format as dist-checkpointing *content metadata*;
a load reads it back, builds the optimizer's sharded state dict in the saved format, and refuses
with :class:`launcher.core.errors.IncompatibleCheckpoint` (a config error, exit 2; naming
both layouts and the fix), before reading any tensor, what Megatron-Core cannot convert:
optimizer state across ``zero_stage`` 0 <-> 1, and across a change in the number of chained
optimizers (MoE with EP > 1 vs EP = 1). The architecture (and the engine) are checked earlier,
for every engine alike, by :mod:`launcher.runtime.resume`.

Four things Megatron-Core 0.16.1 leaves to the training loop (or gets wrong with torch's Adam,
i.e. without Transformer Engine or Apex), each handled here and tested:

* a fresh distributed optimizer has no Adam state, and ``DistributedOptimizer.state_dict`` (used
  by save and load) asserts one common per-parameter ``step``: :func:`prime_optimizer_state`;
* ``fully_reshardable`` loading raises KeyError 'step': :func:`launcher.engines.compat.keep_adam_step`;
* after a load every parameter shares one ``step`` tensor, which then advances once per
  parameter per step: :func:`launcher.engines.compat.unshare_adam_steps`;
* with ``engine.overlap_param_gather`` the other ranks' parameter shards are one update behind
  until the next forward, so the saved model tensors would be stale: :func:`sync_params`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch

from launcher.core.errors import IncompatibleCheckpoint
from launcher.engines import compat
from launcher.parallel import collectives
from launcher.shape.dims import MODEL_PARALLEL_SIZES

SUBDIR = "megatron"
"""Directory inside a step directory that holds the torch_dist files."""

FORMAT_VERSION = 1
"""Version of the content metadata written next to the tensors."""

DISTRIBUTED_SHARDING = "dp_reshardable"
"""Megatron-Core ``distrib_optim_sharding_type`` of distributed-optimizer state by default."""

_LEGACY = {"distrib_optim_sharding_type": "fully_reshardable"}
"""What a checkpoint without content metadata (written before it was recorded) holds."""


def _model_state(chunks: list) -> dict:
    """Sharded state dict of every GPTModel chunk (DDP/Float16Module unwrapped, so keys are the
    model's own names, with global layer numbers)."""
    from megatron.core.utils import unwrap_model

    return {f"chunk{i}": unwrap_model(chunk).sharded_state_dict()
            for i, chunk in enumerate(chunks)}


def _sub_optimizers(optimizer) -> list:
    """The Megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed_subs(optimizer) -> list:
    """The DistributedOptimizers of ``optimizer`` that hold parameters (stubs have none)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [sub for sub in _sub_optimizers(optimizer) if isinstance(sub, DistributedOptimizer)
            and not getattr(sub, "is_stub_optimizer", False)]


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is (made of) Megatron-Core DistributedOptimizer(s) (ZeRO-1)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _sub_optimizers(optimizer))


def layout() -> dict:
    """This run's parallel layout as recorded in (and compared against) a checkpoint."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "vpp": vpp or 1,
            "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def describe(saved: dict) -> str:
    """``zero_stage=1 (TP=2 PP=1 VPP=1 CP=1 EP=1 DP=1)`` for a content-metadata dict."""
    dims = " ".join(f"{k.upper()}={v}" for k, v in saved.get("layout", {}).items())
    return f"zero_stage={saved.get('zero_stage', '?')} ({dims})"


def content_metadata(optimizer, sharding: str = DISTRIBUTED_SHARDING,
                     buffers: Optional[dict] = None) -> dict:
    """What a save records: format version, layout and the optimizer state format
    (``sharding``: engine.optimizer_checkpoint, for the distributed optimizer, and ``buffers``:
    what lays out its flat buffers, :func:`buffer_layout`)."""
    distributed = is_distributed(optimizer)
    metadata = {"trainwright_format": FORMAT_VERSION, "layout": layout(),
                "zero_stage": 1 if distributed else 0,
                "distrib_optim_sharding_type": sharding if distributed else None,
                "optimizers": len(_sub_optimizers(optimizer))}
    if distributed and buffers is not None:
        metadata["buffers"] = dict(buffers)
    return metadata


def optimizer_metadata(saved: dict) -> dict:
    """The ``metadata`` argument of ``optimizer.sharded_state_dict`` for a checkpoint's format
    (the keys Megatron-LM's training loop passes)."""
    metadata = {"chained_optim_avoid_prefix": True, "singleton_local_shards": False}
    if saved.get("distrib_optim_sharding_type"):
        metadata["distrib_optim_sharding_type"] = saved["distrib_optim_sharding_type"]
    return metadata


_ADAM_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
"""Per-parameter Adam state that a fresh optimizer holds as zeros (never the master weights)."""


def _scalar_dtype() -> torch.dtype:
    """The dtype of torch Adam's ``step`` (float64 under a float64 default, else float32)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@torch.no_grad()
def allocate_adam_state(adam) -> bool:
    """Give a torch ``Adam``/``AdamW`` (not fused, capturable nor differentiable: the CPU
    optimizer) the state its first step would allocate, zero moments and step 0, without
    taking that step (a step reads and writes the whole state several times over: 0.8 s of
    gpt2_124m's read at DP2 on a CPU; this is one zero fill). False for any other optimizer,
    which :func:`prime_optimizer_state` steps instead. tests/test_checkpoint_prime.py checks
    the state equals the stepped one in keys, dtypes, shapes and values."""
    if type(adam) not in (torch.optim.Adam, torch.optim.AdamW) or any(
            g.get(flag) for g in adam.param_groups
            for flag in ("fused", "capturable", "differentiable")):
        return False
    for group in adam.param_groups:
        for param in group["params"]:
            if param.numel() == 0:
                continue
            state = adam.state[param]
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for key in keys:
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return True


@torch.no_grad()
def prime_optimizer_state(optimizer) -> None:
    """Allocate the Adam state of every distributed optimizer that has none yet, equal to what
    torch allocates on its first step (zero moments, step 0); weights are left as they are.

    Megatron-Core's ``_init_optimizer_states_with_dummy_values`` takes one optimizer step on zero
    gradients; with lr and weight decay at 0 for that step it changes no weight, and resetting
    the moments and step counts afterwards (per parameter for torch Adam, per group for
    FusedAdam) undoes the step."""
    for sub in _distributed_subs(optimizer):
        if len(sub.optimizer.state) > 0 or allocate_adam_state(sub.optimizer):
            continue
        groups = sub.optimizer.param_groups
        saved = [{k: g[k] for k in ("lr", "weight_decay", "step") if k in g} for g in groups]
        for group in groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
        try:
            sub._init_optimizer_states_with_dummy_values()
        finally:
            for group, before in zip(groups, saved):
                group.pop("step", None)
                group.update(before)
        for state in sub.optimizer.state.values():
            for key in _ADAM_STATE:
                if torch.is_tensor(state.get(key)):
                    state[key].zero_()


def sync_params(chunks: list) -> None:
    """Finish the distributed optimizer's parameter all-gather before a save.

    With ``engine.overlap_param_gather`` the all-gather of the updated shards is deferred to the
    next forward pass, so right after a step each rank holds the other ranks' parameter shards
    one update behind; the model tensors saved from data-parallel rank 0 would be stale (as
    Megatron-LM's training loop, force a synchronous gather first; the next forward then has
    nothing left to gather, so training continues bitwise the same)."""
    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer \
                and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _full_state(chunks: list, optimizer, saved: dict, is_loading: bool,
                with_optimizer: bool = True) -> dict:
    state = {"model": _model_state(chunks)}
    if with_optimizer:
        prime_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], is_loading=is_loading, metadata=optimizer_metadata(saved))
    return state


def incompatibilities(saved: dict, current: dict, where: str = "<that checkpoint>") -> list:
    """What Megatron-Core cannot convert from a checkpoint's content metadata (``saved``) to
    this run's (``current``), each with its fix; empty when it loads (TP, PP, VPP, CP and DP
    changes do: tensors are addressed in model space)."""
    problems = _dp_only_changes(saved, current, where)
    if saved.get("zero_stage", current["zero_stage"]) != current["zero_stage"]:
        problems.append(
            "Megatron-Core cannot convert optimizer state between the distributed optimizer "
            "(zero_stage=1) and the plain one (zero_stage=0). Resume with "
            f"parallelism.zero_stage={saved['zero_stage']} (TP, PP and DP may change).")
    if saved.get("optimizers", current["optimizers"]) != current["optimizers"]:
        ep = saved.get("layout", {}).get("ep", "?")
        problems.append(
            f"The checkpoint holds {saved['optimizers']} optimizer(s) (with MoE and EP > 1 "
            f"expert parameters get their own), this run builds {current['optimizers']}, and "
            "Megatron-Core cannot map the state of one onto the other. Resume with "
            f"parallelism.expert_parallel_size={ep} (TP, PP and DP may change).")
    return problems


BUFFER_SETTINGS = {
    "stage_layers": ("layers per pipeline stage", "parallelism.layers_in_first_stage, "
                     "layers_in_last_stage and account_for_*_in_pipeline_split"),
    "bucket_size": ("gradient bucket size (none without engine.overlap_grad_reduce)",
                    "engine.reduce_bucket_size and engine.overlap_grad_reduce"),
    "grad_reduce_in_fp32": ("fp32 gradient buffers", "engine.grad_reduce_in_fp32"),
    "precision": ("parameter precision", "trainer.precision")}
"""What lays out the distributed optimizer's flat buffers besides the parallel sizes: a
dp_reshardable state (saved as those buffers) loads only where each is unchanged."""


def buffer_layout(*, stage_layers, engine, trainer) -> dict:
    """This run's values of :data:`BUFFER_SETTINGS` (``stage_layers``: layers of every pipeline
    stage, first to last)."""
    return {"stage_layers": [int(n) for n in stage_layers],
            "bucket_size": engine.reduce_bucket_size if engine.overlap_grad_reduce else None,
            "grad_reduce_in_fp32": bool(engine.grad_reduce_in_fp32),
            "precision": str(trainer.precision)}


def _dp_only_changes(saved: dict, current: dict, where: str) -> list:
    """A dp_reshardable optimizer state loads only where nothing but DP changed: neither a
    parallel size nor what lays out the flat buffers (``where``: the step directory, named in
    the conversion command)."""
    if saved.get("distrib_optim_sharding_type") != "dp_reshardable" \
            or current.get("zero_stage") != 1:
        return []
    was, now = saved.get("layout", {}), current.get("layout", {})
    fixes = [f"parallelism.{field}={was[short]}" for short, field, _ in MODEL_PARALLEL_SIZES
             if short in was and was[short] != now.get(short)]
    old, new = saved.get("buffers") or {}, current.get("buffers") or {}
    changed = [f"{BUFFER_SETTINGS[key][0]}: saved {old[key]}, now {new.get(key)} (set "
               f"{BUFFER_SETTINGS[key][1]} as saved)" for key in BUFFER_SETTINGS
               if key in old and key in new and old[key] != new[key]]
    if not fixes and not changed:
        return []
    what = "; ".join(changed) + ". " if changed else ""
    keep = f"resume with {' '.join(fixes)}" if fixes else "resume with the settings above"
    return [f"Its optimizer state was saved with engine.optimizer_checkpoint=dp_reshardable "
            f"(each rank's shard as it was, the fast default), which loads only where TP, PP, "
            f"VPP, CP, EP and the optimizer's buffer layout are unchanged (DP may change). "
            f"{what}To resume at this layout, convert it "
            f"once: python -m launcher.convert reshard checkpoint={where} "
            "out=<new dir> (it runs at the saved layout and writes a copy that loads at any "
            f"layout), then resume with trainer.load=<new dir>. Or {keep}, or start a new run "
            f"from its weights with trainer.init_from={where} (fresh optimizer)."]


def check_compatible(saved: dict, current: dict, source: Path) -> None:
    """Raise IncompatibleCheckpoint (exit 2) when the optimizer state in ``source`` (saved with
    ``saved``) cannot be loaded by this run's optimizer (``current``), naming both layouts and
    every fix; TP, PP and DP changes are loadable."""
    problems = incompatibilities(saved, current, str(Path(source).parent))
    if problems:
        raise IncompatibleCheckpoint(
            f"{source} was saved with {describe(saved)}, this run uses {describe(current)}: "
            + " ".join(problems))


def _load_or_refuse(state: dict, source: Path, saved: dict) -> dict:
    """``dist_checkpointing.load``; a dp_reshardable optimizer state whose flat buffers do not
    fit this run's (a change its records do not show) is refused with the conversion command
    (IncompatibleCheckpoint, exit 2) instead of Megatron-Core's shape error."""
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(state, str(source))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        text = str(exc)
        if saved.get("distrib_optim_sharding_type") != "dp_reshardable" \
                or "optimizer.distributed" not in text or isinstance(exc, KeyboardInterrupt):
            raise
        detail = next((line.strip() for line in text.splitlines()
                       if "optimizer.distributed" in line), "")
        raise IncompatibleCheckpoint(
            f"{source} holds its optimizer state as each rank's flat buffers "
            f"(dp_reshardable), laid out differently from this run's ({detail[:300]}). "
            f"Convert it once with python -m launcher.convert reshard "
            f"checkpoint={source.parent} out=<new dir>, then resume with "
            "trainer.load=<new dir>; or resume with the settings it was saved with.") from exc


class CheckpointWriteFailed(OSError):
    """DCP's ``CheckpointException`` (a BaseException, which ``except Exception`` misses) as the
    write failure it is: its message holds every rank's failure as the coordinator (rank 0) saw
    them, e.g. torch's zip writer on a full disk ("unexpected pos 704 vs 598"); the other ranks
    get none. The checkpoint manager then tells a full disk by its free space."""


@contextlib.contextmanager
def failures_as_errors() -> Iterator[None]:
    """Inside, a DCP ``CheckpointException`` leaves as :class:`CheckpointWriteFailed`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        lines = [f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in
                 sorted(exc.failures.items())]
        raise CheckpointWriteFailed("; ".join(lines) or "the checkpoint write failed on another "
                                    "rank (rank 0's error names it)") from exc


class MegatronCheckpointIO:
    """Save/load a Megatron engine's chunks and optimizer with ``dist_checkpointing``.

    A background write (``trainer.async_save``; the manager asks for one except for the run's
    last save and a save on a stop request) is written by a forked process (Megatron-Core
    ``AsyncCallsQueue``; the fork is a snapshot, so training may change the weights meanwhile);
    :meth:`finish_background` writes the global metadata once every rank's write has finished."""

    def __init__(self, chunks: list, optimizer, sharding: str = DISTRIBUTED_SHARDING,
                 buffers: Optional[dict] = None):
        # a plain str: it is stored in the checkpoint, which loads without running code (no
        # class of ours may be in it)
        self.chunks, self.optimizer, self.sharding = chunks, optimizer, str(sharding)
        self.buffers = buffers  # buffer_layout(): recorded, and compared at a load
        self._queue = None

    def prepare_read(self) -> None:
        """Allocate the optimizer's state a read fills (:func:`prime_optimizer_state`: a second
        of gpt2_124m's read at DP2 on a CPU), while the checkpoint is still downloading."""
        prime_optimizer_state(self.optimizer)

    def _prepare(self, step_dir: Path) -> tuple:
        """(target directory, sharded state dict, content metadata) of a save (collective)."""
        target = Path(step_dir) / SUBDIR
        if collectives.rank() == 0:
            target.mkdir(parents=True, exist_ok=True)
        collectives.barrier()
        sync_params(self.chunks)
        metadata = content_metadata(self.optimizer, self.sharding, self.buffers)
        return target, _full_state(self.chunks, self.optimizer, metadata, is_loading=False), \
            metadata

    def write(self, step_dir: Path, *, background: bool) -> bool:
        """Write ``<step_dir>/megatron`` (collective), or schedule it with ``background``."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        compat.start_save_results_queue()  # an IO built without the engine's builder
        target, state, metadata = self._prepare(step_dir)
        if not background:
            with failures_as_errors():
                dist_checkpointing.save(state, str(target), content_metadata=metadata)
            return False
        with failures_as_errors():
            request = dist_checkpointing.save(state, str(target), content_metadata=metadata,
                                              async_sharded_save=True)
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)
        self._queue.schedule_async_request(request)
        return True

    def finish_background(self, blocking: bool) -> bool:
        """Finish the scheduled writes that every rank has completed (``blocking``: wait for
        all); True when none is left (collective)."""
        if self._queue is None:
            return True
        with failures_as_errors():
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        return self._queue.get_num_unfinalized_calls() == 0

    @torch.no_grad()  # fp32 runs: the dp_reshardable load copies into the leaf parameters
    def read(self, step_dir: Path, with_optimizer: bool = True) -> None:
        """Load ``<step_dir>/megatron`` into this layout (the lr schedule is recomputed from the
        step, so there is none to load)."""
        from megatron.core import dist_checkpointing
        from megatron.core.utils import unwrap_model

        source = Path(step_dir) / SUBDIR
        if not source.is_dir():
            raise FileNotFoundError(f"{source} does not exist (not a Megatron checkpoint?)")
        with compat.checkpoint_loads_without_code():
            # No content metadata: written before it was recorded, always as fully_reshardable.
            saved = dist_checkpointing.load_content_metadata(str(source)) or _LEGACY
            if with_optimizer:
                check_compatible(saved, content_metadata(self.optimizer, self.sharding,
                                                         self.buffers), source)
            state = _full_state(self.chunks, self.optimizer, saved, is_loading=True,
                                with_optimizer=with_optimizer)
            loaded = _load_or_refuse(state, source, saved)
        for i, chunk in enumerate(self.chunks):
            unwrap_model(chunk).load_state_dict(loaded["model"][f"chunk{i}"])
        if with_optimizer:
            subs = _distributed_subs(self.optimizer)
            with compat.keep_adam_step(subs):
                self.optimizer.load_state_dict(loaded["optimizer"])
            compat.unshare_adam_steps(subs)
