"""engine=megatron checkpoints: dist-checkpointing (torch_dist) inside the atomic protocol;
a checkpoint saved at TP=2 or PP=2 loads at TP=1/PP=1 with the same loss on the next batch, and a
resume on the same layout continues bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_engine_deepspeed import fixed_batches
from tests.test_megatron_engine import build

TIED = ["model.untie_embeddings_and_output_weights=false"]
ZERO = ["parallelism.zero_stage=0"]


def _batches(cfg, count: int) -> list:
    next_batch = fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                               cfg.trainer.micro_batch_size, 3)
    return [next_batch() for _ in range(count)]


def _steps(eng, cfg, plan, batches: list, steps: int) -> list:
    """Train ``steps`` steps, each on the next grad_accum batches; (loss, grad norm) per step."""
    from launcher.timers import PhaseTimer

    out, it = [], iter(batches)
    for _ in range(steps):
        result = eng.train_step(lambda: next(it), 1e-3, PhaseTimer())
        out.append([result.loss, result.grad_norm])
    return out


def _save(eng, directory: Path, step: int) -> None:
    from launcher import checkpoint

    checkpoint.save(eng.checkpoint_io, directory, step=step, consumed_samples=step, config={},
                    plan={}, keep_last=2)


def _load(eng, directory: Path) -> None:
    from launcher import checkpoint

    checkpoint.load(eng.checkpoint_io, checkpoint.find_resume(directory.parent))


def _finish() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def reshard_worker(args: dict) -> dict:
    """Save at TP=2 and at PP=2; load each at TP=1/PP=1 (DP=2); resume TP=2 on TP=2."""
    root, out = Path(args["dir"]), {}
    for name, layout in (("tp2", ["parallelism=tp2"]), ("pp2", ["parallelism=pp2"])):
        ckpt = root / name / "checkpoints"
        cfg, plan, eng = build(TIED + layout + ZERO + ["trainer.global_batch_size=4"])
        batches = _batches(cfg, 8)
        out[f"{name}_train"] = _steps(eng, cfg, plan, batches[:4], 2)
        _save(eng, ckpt, 2)
        out[f"{name}_eval"] = eng.eval_loss(batches[4:6])
        out[f"{name}_next"] = _steps(eng, cfg, plan, batches[4:6], 1)
        _finish()
        cfg, plan, eng = build(TIED + layout + ZERO + ["trainer.global_batch_size=4"])
        _load(eng, ckpt)
        out[f"{name}_resumed"] = _steps(eng, cfg, plan, batches[4:6], 1)
        _finish()
        cfg, plan, eng = build(TIED + ZERO + ["trainer.global_batch_size=4"])  # TP=1, PP=1, DP=2
        _load(eng, ckpt)
        out[f"{name}_to_1_eval"] = eng.eval_loss(batches[4:6])
        out["latest"] = (ckpt / "latest").read_text().strip() if (ckpt / "latest").is_file() \
            else (ckpt / "latest").resolve().name
        out["files"] = sorted(p.name for p in (ckpt / "step_000002").iterdir())
        _finish()
    return out


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    from tests._dist import run_distributed

    root = tmp_path_factory.mktemp("megatron_ckpt")
    return run_distributed("tests.test_megatron_checkpoint:reshard_worker", 2,
                           {"dir": str(root)})


@pytest.mark.slow
def test_checkpoint_is_atomic_dist_checkpoint(reshard):
    r0 = reshard[0]
    assert r0["latest"] == "step_000002"
    assert {"complete", "megatron", "rng", "trainwright.json"} <= set(r0["files"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_reshard_to_tp1_pp1_gives_the_same_loss(reshard, layout):
    for rank in reshard:
        saved, loaded = rank[f"{layout}_eval"], rank[f"{layout}_to_1_eval"]
        assert abs(saved - loaded) < 1e-5, (layout, saved, loaded)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_resume_on_the_same_layout_is_bitwise(reshard, layout):
    for rank in reshard:
        assert rank[f"{layout}_resumed"] == rank[f"{layout}_next"], layout
