"""Every parallel layout trained end to end by the real ``python -m launcher.train`` on a CUDA GPU.

Each test launches the launcher as a subprocess (``train`` of tests/helpers/gpu.py) with
``cluster=local_gpu cluster.gpus_per_node=1 cluster.ranks_per_gpu=2``: two training ranks share
ONE GPU (the launcher gives each rank its own ``NCCL_HOSTID``, so NCCL treats them as two hosts
talking over sockets).
The model is conf/model/tiny.yaml with a 512-token vocabulary, in bf16 on mock data
(Megatron-Core's mock GPT dataset: runs of consecutive token ids, which a tiny model learns
within a few steps), 6 optimizer steps at a constant lr of 1e-3 with no warmup (on CPU the
4-layer, 256-wide model falls by about 2 nats in those 6 steps at 1e-3; at 3e-3 it stalls near
5.6 after two steps). Layouts, each one test (engine=megatron unless named):

- TP=2 with sequence parallelism;
- PP=2 (1F1B), 4 micro-batches per step;
- PP=2 x VPP=2 (interleaved schedule, 4 layers = 1 per model chunk);
- DP=2 with zero_stage=0 (plain DDP) and zero_stage=1 (distributed optimizer);
- engine=deepspeed DP=2 with ZeRO stages 1, 2 and 3;
- MoE (4 experts, top-2) at EP=2, with Transformer Engine ("te", skipped where TE is not
  importable) and without it ("no_te": ``TRAINWRIGHT_DISABLE_TE=1`` makes ``import
  transformer_engine`` fail inside the training processes, so a machine that has TE also runs the
  path taken where TE is not installed; where TE is absent anyway the variable changes nothing);
- CP=2 (skipped unless Transformer Engine is importable: Megatron-Core has CP only in TE's
  attention; the sequence length must divide by 2 x CP = 4);
- PP=2 with ``trainer.async_save=true`` and ``trainer.save_interval=2``: the background saves of
  steps 2 and 4 and the (synchronous) final save of step 6 all complete, ``latest`` names step 6;
- save + resume bit for bit (DP=2 ZeRO-1, and PP=2): a run of 6 steps straight, and a run of 3
  steps re-launched with ``trainer.train_steps=6`` (it resumes from its own ``latest``), log the
  identical (==) loss and gradient norm at steps 4-6, and events.jsonl has the resume event. These
  runs ask the GPU for deterministic kernels (``CUBLAS_WORKSPACE_CONFIG``,
  ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, ``trainer.attention_backend=unfused``); steps 1-3 are
  compared first, so run-to-run nondeterminism is told apart from a resume bug.

Every run must: exit 0; log every step 1..N exactly once in metrics.jsonl with a finite loss; log
the seven phase keys ``time/data, time/forward, time/loss, time/backward, time/grad_sync,
time/optimizer, time/checkpoint`` (DeepSpeed fuses backward and gradient reduction and logs
``time/backward+grad_sync`` in place of ``time/backward``); end with a loss clearly below the
first step's; and, for MoE, log a finite ``moe/load_balancing_loss``. plan.json is checked to show
the layout that was asked for.

The module skips without CUDA. On a GPU machine, from the repository root::

    bash bench/device/run_gpu_tests.sh

(installs the wheels carried in .whl/ through bench/device/setup.sh, prints the versions, runs
this module and tests/test_gpu_context_parallel.py). Each launch takes about 30-60 s, mostly
imports; a training process's output is kept in ``<tmp_path>/<run name>.log`` and its tail is
shown when a run fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.helpers.gpu import DP2, MEGATRON, REPO, STEPS, train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PHASES = ("data", "forward", "loss", "backward", "grad_sync", "optimizer", "checkpoint")
"""The phases of launcher.core.phases.PHASES (spelled out: this file names what it checks)."""
FUSED_BACKWARD = "backward+grad_sync"
LOSS_DROP = 0.3
"""The loss at the last step must be at least this much below step 1's (the CPU end-to-end tests
ask 0.3-0.5 over 4-6 steps of the same mock data; this setup falls by about 2)."""
PP2 = ["parallelism=pp2", "trainer.global_batch_size=8"]  # DP=1: 4 micro-batches per step
MOE = ["model.num_experts=4", "model.moe_router_topk=2", "parallelism.expert_parallel_size=2",
       "trainer.global_batch_size=8"]
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
DETERMINISTIC = ["trainer.attention_backend=unfused"]


def te_importable() -> bool:
    """The launcher's own test (launcher.engines.compat.transformer_engine_available)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install failing while it loads its library
        return False
    return True


HAVE_TE = te_importable()


# ---------------------------------------------------------------------------------------------
# helpers


def step_rows(run_dir: Path) -> list:
    """metrics.jsonl training lines in file order (a repeated step shows up twice)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "loss" in row]


def events(run_dir: Path) -> list:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plan_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def check_run(run_dir: Path, *, deepspeed: bool = False, moe: bool = False,
              steps: int = STEPS) -> list:
    """The checks every run passes (see the module docstring); the metric rows."""
    rows = step_rows(run_dir)
    losses = [row["loss"] for row in rows]
    assert [row["step"] for row in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    assert all(math.isfinite(loss) for loss in losses), losses
    backward = FUSED_BACKWARD if deepspeed else "backward"
    keys = {f"time/{phase}" for phase in PHASES if phase != "backward"} | {f"time/{backward}"}
    for row in rows:
        assert keys <= set(row), (sorted(keys - set(row)), row)
        assert deepspeed == ("time/backward" not in row), row
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in keys), row
        for key in ("time/forward", f"time/{backward}", "time/optimizer"):
            assert row[key] > 0, (key, row)
        if moe:
            balance = row.get("moe/load_balancing_loss")
            # 1.0 = perfectly balanced routing; num_experts / top-k = 2.0 = every token to the
            # same two experts (as in tests/test_train_megatron_e2e.py).
            assert balance is not None and math.isfinite(balance) and 0.9 < balance < 2.0, row
    assert losses[-1] < losses[0] - LOSS_DROP, losses
    return rows


def layout(run_dir: Path) -> tuple:
    """(engine, TP, PP, VPP, CP, EP, DP, ZeRO stage, accumulation steps) of plan.json."""
    plan = plan_of(run_dir)
    return tuple(plan[k] for k in (
        "engine", "tensor_parallel_size", "pipeline_parallel_size",
        "virtual_pipeline_parallel_size", "context_parallel_size", "expert_parallel_size",
        "data_parallel_size", "zero_stage", "grad_accum_steps"))


def checkpoint_steps(run_dir: Path) -> dict:
    ckpts = run_dir / "checkpoints"
    return {"latest": (ckpts / "latest").read_text().strip(),
            "complete": sorted(p.parent.name for p in ckpts.glob("step_*/complete")),
            "unfinished": sorted(p.name for p in ckpts.glob("*.tmp"))}


# ---------------------------------------------------------------------------------------------
# layouts


def test_megatron_tp2_sequence_parallel(tmp_path):
    run = train(tmp_path, "tp2_sp", *MEGATRON, "parallelism=tp2", "trainer.global_batch_size=4")
    check_run(run)
    assert layout(run) == ("megatron", 2, 1, 1, 1, 1, 1, 1, 2)
    assert plan_of(run)["sequence_parallel"] is True


def test_megatron_pp2_1f1b(tmp_path):
    run = train(tmp_path, "pp2", *MEGATRON, *PP2)
    rows = check_run(run)
    assert layout(run) == ("megatron", 1, 2, 1, 1, 1, 1, 1, 4)
    # Phase times are the maximum over the stages: only the last stage computes the loss.
    assert all(row["time/loss"] > 0 for row in rows), rows


def test_megatron_pp2_vpp2_interleaved(tmp_path):
    run = train(tmp_path, "pp2_vpp2", *MEGATRON, *PP2, "model.num_layers=4",
                "parallelism.virtual_pipeline_parallel_size=2")
    check_run(run)
    assert layout(run) == ("megatron", 1, 2, 2, 1, 1, 1, 1, 4)


@pytest.mark.parametrize("zero_stage", [0, 1], ids=["ddp", "distributed_optimizer"])
def test_megatron_dp2(tmp_path, zero_stage):
    run = train(tmp_path, f"dp2_zero{zero_stage}", *MEGATRON, *DP2,
                f"parallelism.zero_stage={zero_stage}")
    check_run(run)
    assert layout(run) == ("megatron", 1, 1, 1, 1, 1, 2, zero_stage, 2)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_dp2_zero(tmp_path, zero_stage):
    run = train(tmp_path, f"ds_zero{zero_stage}", "engine=deepspeed", *DP2,
                f"parallelism.zero_stage={zero_stage}")
    check_run(run, deepspeed=True)
    assert layout(run) == ("deepspeed", 1, 1, 1, 1, 1, 2, zero_stage, 2)
    ds = json.loads((run / "ds_config.json").read_text())
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"],
            ds["zero_optimization"]["stage"]) == (8, 2, zero_stage)


@pytest.mark.parametrize("te", ["te", "no_te"])
def test_megatron_moe_ep2(tmp_path, te):
    """``no_te`` hides Transformer Engine from the training processes (TRAINWRIGHT_DISABLE_TE=1,
    honoured by launcher.engines.compat): MoE must train on Megatron-Core's local layers too."""
    if te == "te" and not HAVE_TE:
        pytest.skip("transformer_engine is not importable here")
    env = {"TRAINWRIGHT_DISABLE_TE": "1"} if te == "no_te" else {"TRAINWRIGHT_DISABLE_TE": "0"}
    run = train(tmp_path, f"moe_ep2_{te}", *MEGATRON, *MOE, env=env)
    check_run(run, moe=True)
    plan = plan_of(run)
    assert (plan["expert_parallel_size"], plan["expert_data_parallel_size"],
            plan["data_parallel_size"]) == (2, 1, 2)
    # Without TE, the flash attention the plan counted (attention_backend=auto on a GPU) is
    # replaced by unfused attention, and the run says so.
    attention_notes = [e for e in events(run) if e["kind"] == "attention"]
    assert bool(attention_notes) == (te == "no_te"), events(run)


@pytest.mark.skipif(not HAVE_TE, reason="context parallelism needs Transformer Engine")
def test_megatron_cp2(tmp_path):
    from omegaconf import OmegaConf

    seq_length = OmegaConf.load(REPO / "conf" / "model" / "tiny.yaml").seq_length
    assert seq_length % 4 == 0, "CP=2 splits each sequence into 2 x CP load-balanced chunks"
    run = train(tmp_path, "cp2", *MEGATRON, "parallelism.context_parallel_size=2",
                "trainer.global_batch_size=4")
    check_run(run)
    assert layout(run) == ("megatron", 1, 1, 1, 2, 1, 1, 1, 2)


def test_megatron_pp2_async_save(tmp_path):
    run = train(tmp_path, "pp2_async", *MEGATRON, *PP2, "trainer.async_save=true",
                "trainer.save_interval=2", "trainer.keep_last=0")
    rows = check_run(run)
    assert layout(run)[:3] == ("megatron", 1, 2)
    saved = checkpoint_steps(run)
    assert saved == {"latest": "step_000006", "unfinished": [],
                     "complete": ["step_000002", "step_000004", "step_000006"]}, saved
    for step in (2, 4, 6):
        step_dir = run / "checkpoints" / f"step_{step:06d}"
        meta = json.loads((step_dir / "trainwright.json").read_text())
        assert (meta["step"], meta["consumed_samples"]) == (step, 8 * step), meta
        assert any(p.name.endswith(".distcp") for p in (step_dir / "megatron").iterdir())
        assert rows[step - 1]["time/checkpoint"] > 0, rows[step - 1]


@pytest.mark.parametrize("variant", [
    pytest.param([*DP2, "parallelism.zero_stage=1"], id="dp2_zero1"),
    pytest.param(PP2, id="pp2"),
])
def test_megatron_resume_is_bitwise(tmp_path, variant):
    overrides = [*MEGATRON, *variant, *DETERMINISTIC]
    straight_dir = train(tmp_path, "straight", *overrides, env=DETERMINISTIC_ENV)
    half = STEPS // 2
    resumed_dir = train(tmp_path, "resumed", *overrides, f"trainer.train_steps={half}",
                        env=DETERMINISTIC_ENV)
    assert checkpoint_steps(resumed_dir)["latest"] == f"step_{half:06d}"
    train(tmp_path, "resumed", *overrides, env=DETERMINISTIC_ENV)  # same run dir: resumes

    straight = check_run(straight_dir)
    resumed = check_run(resumed_dir)  # every step once: none repeated or skipped by the resume
    key = ("loss", "grad_norm", "consumed_samples")
    first = [[row[k] for k in key] for row in straight[:half]]
    assert [[row[k] for k in key] for row in resumed[:half]] == first, (
        "steps 1-3 already differ between two identical launches: the GPU run is not "
        "deterministic (not a resume bug)")
    assert [[row[k] for k in key] for row in resumed[half:]] == \
        [[row[k] for k in key] for row in straight[half:]]
    resumes = [e for e in events(resumed_dir) if e["kind"] == "resume"]
    assert len(resumes) == 1 and f"at step {half}" in resumes[0]["message"], resumes
    assert checkpoint_steps(resumed_dir)["latest"] == f"step_{STEPS:06d}"
