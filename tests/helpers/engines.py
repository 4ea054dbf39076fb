"""Engines built in-process on the current process group (1-rank gloo, or a rank of
:func:`tests.helpers.dist.run_distributed`): the tiny model's composed config (``cfg_of``, on top
of ``TINY``), fixed training batches (``fixed_batches``), and an ``engine=megatron`` engine
(``build``, on top of ``MEGATRON``; ``MOE`` adds a 4-expert top-2 MoE at EP=2).

Formerly in tests/test_engine_deepspeed.py (``TINY``, ``cfg_of``, ``fixed_batches``) and
tests/test_megatron_engine.py (``MEGATRON``, ``MOE``, ``build``).
"""

from __future__ import annotations

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
