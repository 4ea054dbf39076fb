"""Engines built in-process on the current process group (1-rank gloo, or a rank of
:func:`tests.helpers.dist.run_distributed`): the tiny model's composed config (``cfg_of``, on top
of ``TINY``), fixed training batches (``fixed_batches``), and an ``engine=megatron`` engine
(``build``, on top of ``MEGATRON``; ``MOE`` adds a 4-expert top-2 MoE at EP=2), and a few
steps trained on the fixed batches: ``train`` (an engine built by ``build``) and ``run_layout``
(an engine=deepspeed engine built from overrides), each saying which of torch Adam's
implementations the steps ran (``adam_paths``).

Formerly in tests/test_engine_deepspeed.py (``TINY``, ``cfg_of``, ``fixed_batches``,
``run_layout``) and tests/test_megatron_engine.py (``MEGATRON``, ``MOE``, ``build``,
``global_params``, ``copy_weights``, ``train``); tests/test_post_norm_layers.py trains with both.
"""

from __future__ import annotations

from contextlib import contextmanager

from launcher.compose import compose_config, to_object

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512",
        "model.seq_length=32", "trainer.precision=fp32", "trainer.micro_batch_size=2",
        "trainer.train_steps=8", "optimizer.warmup_steps=0", "optimizer.lr=3e-3"]


def cfg_of(overrides):
    return to_object(compose_config(TINY + list(overrides)))


def fixed_batches(vocab: int, seq: int, micro: int, seed: int):
    """An endless cycle over 2 fixed micro-batches (so a few steps visibly lower the loss)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(2):
        ids = torch.randint(1, vocab, (micro, seq + 1), generator=gen)
        data.append(dict(tokens=ids[:, :-1], labels=ids[:, 1:],
                         loss_mask=torch.ones(micro, seq),
                         position_ids=torch.arange(seq).expand(micro, seq)))
    state = {"i": 0}

    def next_batch():
        state["i"] += 1
        return data[state["i"] % 2]
    return next_batch


MEGATRON = ["engine=megatron", "model.num_layers=4"]
MOE = ["model.num_experts=4", "model.moe_router_topk=2", "parallelism.expert_parallel_size=2",
       "model.moe_aux_loss_coeff=0.01", "model.moe_capacity_factor=1.5"]


def build(overrides):
    """(cfg, plan, engine) for ``overrides`` on this process group."""
    import torch

    from launcher.engines import engine_inputs, spec
    from launcher.engines.model import init_parallel_state
    from launcher.plan import compute_plan

    cfg = cfg_of(MEGATRON + list(overrides))
    plan = compute_plan(cfg, world_size=torch.distributed.get_world_size())
    init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
    eng = spec(cfg.engine.name).build(batch=plan.batch, model=cfg.model, **engine_inputs(cfg))
    return cfg, plan, eng


def global_params(eng) -> dict:
    """{global parameter name: tensor} of this rank's chunks (layer numbers made global)."""
    out = {}
    for chunk in eng.chunks:
        gpt = chunk.module
        local_to_global = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                           for i, layer in enumerate(gpt.decoder.layers)}
        for name, param in gpt.named_parameters():
            for local, glob in local_to_global.items():
                if name.startswith(local):
                    name = glob + name[len(local):]
                    break
            out[name] = param
    return out


@contextmanager
def adam_paths():
    """The names of torch Adam's implementations (``_single_tensor_adam``,
    ``_multi_tensor_adam``) that optimizer steps call inside the block, in call order."""
    import torch.optim.adam as adam

    seen, names = [], ("_single_tensor_adam", "_multi_tensor_adam")
    originals = {name: getattr(adam, name) for name in names}

    def counted(name, run):
        def wrapper(*args, **kwargs):
            seen.append(name)
            return run(*args, **kwargs)
        return wrapper
    for name, run in originals.items():
        setattr(adam, name, counted(name, run))
    try:
        yield seen
    finally:
        for name, run in originals.items():
            setattr(adam, name, run)


def copy_weights(eng, reference: dict) -> None:
    """Give ``eng`` the weights of a PP=1 model (tied output layer = word embeddings)."""
    import torch

    with torch.no_grad():
        for name, param in global_params(eng).items():
            tied = name == "output_layer.weight" and name not in reference
            param.copy_(reference["embedding.word_embeddings.weight" if tied else name])


def train(eng, cfg, steps: int, data_seed: int = 0, reference=None) -> dict:
    """Train ``steps`` steps on the fixed batches; losses, grad norms, extras, phase times."""
    from megatron.core import parallel_state

    from launcher.core.phases import PhaseTimer
    from launcher.runtime.schedule import lr_at

    if reference is not None:
        copy_weights(eng, reference)
    next_batch = fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                               cfg.trainer.micro_batch_size, data_seed)
    timer, out = PhaseTimer(), {"loss": [], "grad_norm": [], "extra": []}
    with adam_paths() as paths:
        for step in range(steps):
            result = eng.train_step(next_batch, lr_at(step, optimizer=cfg.optimizer,
                                                      total_steps=steps), timer)
            for key in out:
                out[key].append(getattr(result, key))
    out["times"], out["adam_paths"] = timer.snapshot(), sorted(set(paths))
    parallel_state.destroy_model_parallel()
    return out


def run_layout(overrides, steps: int, data_seed: int) -> dict:
    """Build the engine for ``overrides`` on this process group, train ``steps`` steps."""
    import torch
    from megatron.core import parallel_state

    from launcher.core.phases import PhaseTimer
    from launcher.engines.deepspeed.engine import build_engine
    from launcher.engines.model import init_parallel_state
    from launcher.plan import compute_plan
    from launcher.runtime.schedule import lr_at

    cfg = cfg_of(overrides)
    plan = compute_plan(cfg, world_size=torch.distributed.get_world_size())
    init_parallel_state(cfg.parallelism, seed=cfg.trainer.seed)
    eng = build_engine(batch=plan.batch, model=cfg.model, parallelism=cfg.parallelism,
                       optimizer=cfg.optimizer, trainer=cfg.trainer, engine=cfg.engine)
    next_batch = fixed_batches(cfg.model.vocab_size, cfg.model.seq_length,
                               cfg.trainer.micro_batch_size, data_seed)
    timer, out = PhaseTimer(), {"loss": [], "grad_norm": [], "loss_scale": []}
    with adam_paths() as paths:
        for step in range(steps):
            lr = lr_at(step, optimizer=cfg.optimizer, total_steps=plan.batch.train_steps)
            result = eng.train_step(next_batch, lr, timer)
            for key in out:
                out[key].append(getattr(result, key))
    out["times"], out["adam_paths"] = timer.snapshot(), sorted(set(paths))
    parallel_state.destroy_model_parallel()
    return out
