"""Resume safety: what a checkpoint records about the run that wrote it, and what a resume checks.

Every checkpoint's ``trainwright.json`` holds, next to the resolved config and plan, three compact
records of the run that wrote it (:func:`run_record`, written by
:class:`launcher.runtime.checkpoint.CheckpointManager`):

* ``architecture``: every model setting that gives the weights their meaning, with the config's
  0-sentinels resolved (:data:`ARCHITECTURE_KEYS`); dropout, init and the MoE loss and capacity
  are training settings and are not part of it;
* ``layout``: engine, TP, PP, VPP, CP, EP, DP, ZeRO stage, world size and layers per stage;
* ``training``: global and micro batch, accumulation, sequence length and train steps.

A resume, in order (``launcher.train``):

1. :func:`refuse_incompatible`, before the engine is built: a different architecture or engine
   raises :class:`~launcher.core.errors.IncompatibleCheckpoint` (exit 2) naming every
   differing field with both values and the fix. Layout changes are the engine's to judge, in its
   checkpoint reader before any tensor is read (Megatron-Core reshards TP/PP/DP; see
   :func:`launcher.engines.megatron.checkpoint.check_compatible` and
   :func:`launcher.engines.deepspeed.engine.check_layout`).
2. :func:`already_trained`: a checkpoint at or past the planned ``train_steps`` has nothing left
   to train; an ``already_trained`` event says so and the process exits 0 without building
   anything (a run is never rewound).
3. the load, then :func:`report_changes`: a changed global or micro batch, sequence length,
   train steps (learning-rate schedule) or layout is logged as an event (events.jsonl and
   the console) naming the step and where the consumed samples continue.
4. :func:`started`: only now are config.yaml, plan.json and data.json rewritten
   (:mod:`launcher.runtime.confighistory`).

A checkpoint written before these records existed is checked against the config and plan stored
beside them; one with neither is loaded unchecked (an event says so), and a changed shape then
shows in the load error, which names every tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from launcher.core.checkpoints import Resume, read_meta
from launcher.core.errors import IncompatibleCheckpoint
from launcher.parallel import collectives
from launcher.shape import MODEL_PARALLEL_SIZES, ResolvedModel
from launcher.shape.model import ARCHITECTURE_KEYS, DERIVED

__all__ = ["ARCHITECTURE_KEYS", "already_trained", "architecture", "architecture_changes",
           "layout", "refuse_incompatible", "report_changes", "run_record", "saved_record",
           "started", "training"]

LAYOUT_KEYS = ("engine", "tensor_parallel_size", "pipeline_parallel_size",
               "virtual_pipeline_parallel_size", "context_parallel_size",
               "expert_parallel_size", "data_parallel_size", "zero_stage", "world_size",
               "stage_layers")
TRAINING_KEYS = ("global_batch_size", "micro_batch_size", "grad_accum_steps", "seq_length",
                 "train_steps")


def architecture(model: Mapping) -> dict:
    """The architecture record of ``model`` (ModelConfig fields as a mapping; fields it lacks, as
    in a config saved before they existed, take their defaults): :class:`ResolvedModel`'s."""
    return ResolvedModel.of_fields(model).architecture()


def layout(plan: Mapping) -> dict:
    """The layout record of a plan (``Plan.to_dict()``)."""
    record = {key: plan.get(key) for key in LAYOUT_KEYS}
    record["stage_layers"] = list(record["stage_layers"] or [])  # as json reads it back
    return record


def training(plan: Mapping) -> dict:
    """The training record of a plan (``Plan.to_dict()``)."""
    return {key: plan.get(key) for key in TRAINING_KEYS}


def run_record(cfg, plan) -> dict:
    """This run's records, as every checkpoint it writes stores them."""
    plan_dict = plan.to_dict()
    return {"architecture": ResolvedModel.of(cfg.model).architecture(),
            "layout": layout(plan_dict), "training": training(plan_dict)}


def saved_record(meta: Mapping) -> dict:
    """A checkpoint's records from its ``trainwright.json``; for one written before they were
    recorded, derived from the config and plan saved beside them (missing ones: absent)."""
    out = {key: meta[key] for key in ("architecture", "layout", "training") if key in meta}
    config, plan = meta.get("config") or {}, meta.get("plan") or {}
    if "architecture" not in out and isinstance(config.get("model"), Mapping) \
            and "num_attention_heads" in config["model"]:
        out["architecture"] = architecture(config["model"])
    if plan.get("engine"):
        out.setdefault("layout", layout(plan))
        out.setdefault("training", training(plan))
    return out


def _label(key: str) -> str:
    return f"{key} ({DERIVED[key]})" if key in DERIVED else f"model.{key}"


def architecture_changes(saved: Mapping, now: Mapping) -> list:
    """``model.<key>: checkpoint <a>, now <b>`` for every architecture entry that differs."""
    return [f"{_label(key)}: checkpoint {saved.get(key)}, now {now.get(key)}"
            for key in ARCHITECTURE_KEYS if key in saved and saved.get(key) != now.get(key)]


def _fix(saved: Mapping, now: Mapping) -> str:
    """How to resume the checkpoint instead: its values of the settable keys."""
    keys = [k for k in ARCHITECTURE_KEYS if k in saved and saved[k] != now.get(k)]
    values = [f"model.{k}={saved[k]}" for k in keys if k not in DERIVED and saved[k] is not None]
    if any(k in DERIVED for k in keys) and "arch" not in keys:
        values.append(f"model.arch={saved.get('arch')}")
    return " ".join(values)


def incompatibilities(resume: Resume, record: Mapping) -> Optional[str]:
    """Why ``resume`` must not be loaded by a run with ``record`` (None when it may)."""
    saved = saved_record(read_meta(resume.path))
    problems = architecture_changes(saved.get("architecture", {}), record["architecture"])
    saved_layout = saved.get("layout", {})
    engine, now_engine = saved_layout.get("engine"), record["layout"]["engine"]
    if engine and engine != now_engine:
        problems.append(f"engine: checkpoint {engine}, now {now_engine} (the engines' "
                        "checkpoint formats differ)")
    if not problems:
        return None
    fix = _fix(saved.get("architecture", {}), record["architecture"])
    if engine and engine != now_engine:
        fix = f"{fix} engine={engine}".strip()
    return (f"checkpoint {resume.where} does not match this run's model: " + "; ".join(problems)
            + ". Nothing was loaded. To resume it, set the checkpoint's values (" + fix
            + "); to train this configuration instead, start a new run (another run.name, "
            "without trainer.load).")


def refuse_incompatible(resume: Optional[Resume], record: Mapping) -> None:
    """Raise IncompatibleCheckpoint (exit 2) on every rank when ``resume`` was written by a
    different architecture or engine than ``record``'s (collective; before any tensor is read)."""
    problem = None if resume is None else incompatibilities(resume, record)
    if collectives.any_rank(problem is not None):
        raise IncompatibleCheckpoint(problem or f"another rank refused checkpoint "
                                                f"{resume.where if resume else ''}")


def already_trained(resume: Optional[Resume], train_steps: int, metrics) -> bool:
    """True (on every rank) when ``resume`` is at or past ``train_steps``: an event says
    that nothing is left to train, and the caller exits 0 without training (collective)."""
    done = resume is not None and resume.step >= train_steps
    if not collectives.any_rank(done):
        return False
    if resume is None:  # another rank found a checkpoint this one did not: stop all the same
        return True
    where = ("which reaches" if resume.step == train_steps else "past") + \
        f" the {train_steps} steps trainer.train_steps/train_tokens ask for"
    metrics.log_event("already_trained",
                      f"nothing to train: checkpoint {resume.where} is at step {resume.step}, "
                      f"{where}; exiting 0 without training (a run is never rewound). To train "
                      f"on, raise trainer.train_steps (or trainer.train_tokens) above "
                      f"{resume.step}", step=resume.step, train_steps=train_steps)
    return True


def _describe_layout(record: Mapping) -> str:
    short = {field: label for _, field, label in MODEL_PARALLEL_SIZES}
    short.update(data_parallel_size="DP", zero_stage="ZeRO")
    text = " ".join(f"{name}={record.get(key)}" for key, name in short.items())
    stages = record.get("stage_layers") or []
    return text + (f" stages={list(stages)}" if len(set(stages)) > 1 else "")


def _batch_changes(old: Mapping, new: Mapping, resume: Resume) -> list:
    """(kind, message) for a changed global or micro batch or sequence length."""
    at, samples = f"at step {resume.step}", resume.consumed_samples
    out = []
    if old.get("global_batch_size") not in (None, new["global_batch_size"]):
        out.append(("batch_change", f"global batch changed from {old['global_batch_size']} to "
                    f"{new['global_batch_size']} {at}: consumed samples continue at {samples} "
                    f"(each step now consumes {new['global_batch_size']} samples; the "
                    "learning-rate schedule continues by step)"))
    if old.get("micro_batch_size") not in (None, new["micro_batch_size"]):
        out.append(("batch_change", f"micro batch changed from {old['micro_batch_size']} to "
                    f"{new['micro_batch_size']} {at}: {new['grad_accum_steps']} accumulation "
                    f"step(s) per optimizer step (was {old.get('grad_accum_steps')}); consumed "
                    f"samples continue at {samples}"))
    if old.get("seq_length") not in (None, new["seq_length"]):
        out.append(("batch_change", f"sequence length changed from {old['seq_length']} to "
                    f"{new['seq_length']} {at}: consumed samples continue at {samples}, now "
                    f"samples of {new['seq_length']} tokens"))
    return out


def _schedule_change(old: Mapping, new: Mapping, resume: Resume, optimizer) -> list:
    """(kind, message) when train_steps changed: the lr schedule is recomputed."""
    from launcher.runtime.schedule import lr_at

    before, after = old.get("train_steps"), new["train_steps"]
    if before in (None, after) or optimizer is None:
        return []
    lrs = [lr_at(resume.step, optimizer=optimizer, total_steps=total) for total in (before, after)]
    return [("schedule_change", f"train steps changed from {before} to {after} at step "
             f"{resume.step}: the learning-rate schedule now spans {after} steps (lr of the next "
             f"step {lrs[0]:.3e} before, {lrs[1]:.3e} now)")]


def _layout_change(old: Mapping, new: Mapping, resume: Resume) -> list:
    # A checkpoint written before stage_layers was recorded had the even split.
    keys = [k for k in LAYOUT_KEYS if k not in ("engine", "world_size")
            and (k in old or k != "stage_layers")]
    if not old or all(old.get(k) == new.get(k) for k in keys):
        return []
    return [("layout_change", f"parallel layout changed from {_describe_layout(old)} to "
             f"{_describe_layout(new)} at step {resume.step}: the engine resharded the "
             "checkpoint")]


def report_changes(resume: Resume, record: Mapping, metrics, optimizer=None) -> list:
    """Log (events.jsonl and console) what a resume changed against ``resume``'s records: global
    or micro batch, sequence length, train steps, parallel layout. Returns (kind, message)s."""
    saved = saved_record(read_meta(resume.path))
    old, new = saved.get("training") or {}, record["training"]
    changes = (_batch_changes(old, new, resume) + _schedule_change(old, new, resume, optimizer)
               + _layout_change(saved.get("layout") or {}, record["layout"], resume))
    for kind, message in changes:
        metrics.log_event(kind, message, step=resume.step,
                          consumed_samples=resume.consumed_samples)
    return changes


def started(run_dir: Path, *, config: Any, plan, files: Optional[Mapping] = None) -> None:
    """This start got going (checkpoint loaded, or a fresh engine built): rank 0 writes what the
    run directory says about its run, config.yaml, plan.json, data.json and the engine's
    ``files`` (e.g. ds_config.json); a refused or failed start never gets here."""
    from launcher.runtime.rundir import write_run_files

    if collectives.rank() == 0:
        write_run_files(Path(run_dir), config=config, plan=plan, extra=files)


def resume_state(checkpoints, resume: Optional[Resume], record: Mapping, metrics,
                 optimizer=None):
    """The loop's starting :class:`~launcher.runtime.loop.LoopState`: fresh without ``resume``;
    else after loading it through ``checkpoints`` (collective), with a ``resume`` event and one
    event per change (:func:`report_changes`)."""
    from launcher.runtime.loop import LoopState

    if resume is None:
        return LoopState()
    if "architecture" not in saved_record(read_meta(resume.path)):
        metrics.log_event("resume_unchecked", f"checkpoint {resume.where} records no "
                          "architecture (written before trainwright recorded one): loading it "
                          "without comparing the model settings")
    resume = checkpoints.load(resume)
    metrics.log_event("resume", f"resumed from {resume.path} at step {resume.step}" + (
        f" (downloaded from {resume.origin})" if resume.origin else ""))
    report_changes(resume, record, metrics, optimizer)
    return LoopState(step=resume.step, consumed_samples=resume.consumed_samples,
                     last_saved=resume.step)
