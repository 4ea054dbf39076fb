"""Engine selection: ``engine.name`` -> the engine object the training loop drives.

Both engines expose ``train_step(next_batch, lr, timer) -> StepResult``, ``eval_loss``,
``grad_norm``, ``loss_scale`` and ``checkpoint_io`` (what :mod:`launcher.checkpoint` saves).
"""

from __future__ import annotations

from typing import Optional

from launcher.config import EngineName


def build_engine_for(name, plan, *, model, parallelism, optimizer, trainer, engine,
                     ds_config: Optional[dict] = None):
    """Build the DeepSpeed or the Megatron-Core engine on an initialised parallel state."""
    if EngineName(name) == EngineName.megatron:
        from launcher.megatron_engine import build_megatron_engine

        return build_megatron_engine(plan, model=model, parallelism=parallelism,
                                     optimizer=optimizer, trainer=trainer, engine=engine)
    from launcher.engine import build_engine

    if parallelism.pipeline_parallel_size > 1:
        raise ValueError(f"engine=deepspeed does not pipeline in trainwright "
                         f"(pipeline_parallel_size={parallelism.pipeline_parallel_size}); use "
                         "engine=megatron")
    return build_engine(plan, model=model, parallelism=parallelism, optimizer=optimizer,
                        trainer=trainer, engine=engine, ds_config=ds_config)
