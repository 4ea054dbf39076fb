"""Where each Megatron-Core tensor lives in a Hugging Face checkpoint, per architecture.

The pivot is Megatron-Core's own *model space*: a tensor is addressed by its dist-checkpointing
key (``decoder.layers.self_attention.linear_qkv.weight``) and its index along the stacked axes
(``(layer,)``, or ``(layer, expert)`` for experts), and holds the whole unsharded tensor of that
layer. Every layout (TP/PP/VPP/EP) is a slicing of it that Megatron-Core describes itself
(``sharded_state_dict``), and torch_dist checkpoints store exactly these tensors.

Facts the mapping relies on (Megatron-Core 0.16, transformers 4.45-5.x):

* fused QKV rows are grouped by key/value head: for each of the ``G`` groups, its ``H/G`` query
  heads, then its key head, then its value head (``head_dim`` rows each); HF keeps separate
  ``q_proj``/``k_proj``/``v_proj`` (GPT-2: one ``c_attn`` with all queries, then keys, values);
* the SwiGLU input projection ``linear_fc1`` is ``[gate; up]`` (HF ``gate_proj``/``up_proj``,
  Mixtral ``w1``/``w3``), the output projection ``linear_fc2`` is ``down_proj``/``w2``;
* the pre-attention and pre-MLP norms are saved under the TE-fused names
  ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight`` by every layer spec;
* Megatron-Core RoPE rotates halves (``rotary_interleaved=False``), as HF Llama does, so query
  and key rows need no permutation;
* the embedding and output layer are padded to the model's padded vocabulary; HF holds
  ``vocab_size`` rows (padding rows are zero on import and dropped on export);
* GPT-2's HF ``Conv1D`` stores weights as ``[in, out]``: transposed against ``nn.Linear``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from launcher.config import HfFamily, NormPlacement
from launcher.shape import ResolvedModel

L = "decoder.layers."
EXPERTS = L + "mlp.experts.experts."


@dataclass(frozen=True)
class Rule:
    """One Megatron-Core key and the HF tensors it is made of."""

    key: str
    hf: tuple  # name templates with {l} (layer) and {e} (expert)
    kind: str  # copy | vocab | qkv | qkv_fused | glu | t | gpt2_qkv | gpt2_qkv_bias
    stacked: int  # 0 (whole model), 1 (per layer) or 2 (per layer and expert)
    layers: str = "all"  # the layers that hold it: all, dense (no experts) or moe


def _holds(rule: Rule, d: ResolvedModel, layer: int) -> bool:
    """Whether layer ``layer`` has the tensor of ``rule`` (DeepSeek-V3's first layers are
    dense, the others hold experts)."""
    return rule.layers == "all" or (rule.layers == "moe") == d.moe_layer(layer)


def _latent_attention_rules(d: ResolvedModel, p: str) -> list[Rule]:
    """DeepSeek-V3's multi-latent attention: the query latent (``q_a_proj``, its norm,
    ``q_b_proj``; or one ``q_proj``), the key/value latent with the shared rotated key
    (``kv_a_proj_with_mqa``), its norm and ``kv_b_proj``. Megatron-Core's tensors have the same
    row order (per head: unrotated, then rotated query; unrotated key, then value), and it
    rotates query/key pairs interleaved as ``rope_interleave`` does, so all are copies."""
    a = L + "self_attention."
    names = [("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
             ("linear_kv_up_proj.layer_norm_weight", "kv_a_layernorm.weight"),
             ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
             ("linear_proj.weight", "o_proj.weight")]
    if d.q_lora:
        names = [("linear_q_down_proj.weight", "q_a_proj.weight"),
                 ("linear_q_up_proj.layer_norm_weight", "q_a_layernorm.weight"),
                 ("linear_q_up_proj.weight", "q_b_proj.weight")] + names
    else:
        names = [("linear_q_proj.weight", "q_proj.weight")] + names
    return [Rule(L + "input_layernorm.weight", (p + "input_layernorm.weight",), "copy", 1)] + [
        Rule(a + ours, (p + "self_attn." + theirs,), "copy", 1) for ours, theirs in names]


def _deepseek_mlp_rules(d: ResolvedModel, p: str) -> list[Rule]:
    """DeepSeek-V3's MLPs: dense in the first layers (the pre-MLP norm fused into linear_fc1's
    name, as Transformer Engine's spec saves it), else a sigmoid router with its load-balancing
    bias (``e_score_correction_bias``), the routed experts and a shared expert."""
    glu = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
    shared = p + "mlp.shared_experts."
    rules = [Rule(L + "mlp.linear_fc1.layer_norm_weight", (p + "post_attention_layernorm.weight",),
                  "copy", 1, "dense"),
             Rule(L + "mlp.linear_fc1.weight", glu, "glu", 1, "dense"),
             Rule(L + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "copy", 1, "dense"),
             Rule(L + "pre_mlp_layernorm.weight", (p + "post_attention_layernorm.weight",),
                  "copy", 1, "moe"),
             Rule(L + "mlp.router.weight", (p + "mlp.gate.weight",), "copy", 1, "moe"),
             Rule(L + "mlp.router.expert_bias", (p + "mlp.gate.e_score_correction_bias",),
                  "copy", 1, "moe"),
             Rule(EXPERTS + "linear_fc1.weight", (p + "mlp.experts.{e}.gate_proj.weight",
                                                  p + "mlp.experts.{e}.up_proj.weight"),
                  "glu", 2, "moe"),
             Rule(EXPERTS + "linear_fc2.weight", (p + "mlp.experts.{e}.down_proj.weight",),
                  "copy", 2, "moe"),
             Rule(L + "mlp.shared_experts.linear_fc1.weight",
                  (shared + "gate_proj.weight", shared + "up_proj.weight"), "glu", 1, "moe"),
             Rule(L + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",),
                  "copy", 1, "moe")]
    return [r for r in rules if (d.expert_bias or not r.key.endswith("expert_bias"))
            and (d.shared_ffn or "shared_experts" not in r.key)]


def _deepseek_rules(d: ResolvedModel) -> list[Rule]:
    p = "model.layers.{l}."
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)]
    rules += _latent_attention_rules(d, p) + _deepseek_mlp_rules(d, p)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", 0))
    if not d.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return rules


def _llama_rules(d: ResolvedModel) -> list[Rule]:
    p = "model.layers.{l}."
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
             _qkv_rule(d, p)] + _layer_norm_rules(d, p)
    if d.qkv_bias:  # Qwen2: biases on q, k and v only, grouped as their rows
        rules.append(Rule(L + "self_attention.linear_qkv.bias",
                          tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv"), "qkv", 1))
    if d.qk_norm:  # Qwen3: over each head, one weight; OLMo 2: over all heads (split over TP)
        rules += [Rule(L + "self_attention.q_layernorm.weight", (p + "self_attn.q_norm.weight",),
                       "copy", 1),
                  Rule(L + "self_attention.k_layernorm.weight", (p + "self_attn.k_norm.weight",),
                       "copy", 1)]
    rules.append(Rule(L + "self_attention.linear_proj.weight", (p + "self_attn.o_proj.weight",),
                      "copy", 1))
    if d.experts:
        rules += _expert_rules(d, p)
    elif d.family == HfFamily.phi3:  # gate_up_proj is [gate; up], as linear_fc1
        rules += [Rule(L + "mlp.linear_fc1.weight", (p + "mlp.gate_up_proj.weight",), "copy", 1),
                  Rule(L + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "copy", 1)]
    else:
        rules += [Rule(L + "mlp.linear_fc1.weight",
                       (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "glu", 1),
                  Rule(L + "mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",), "copy", 1)]
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", 0))
    if not d.tied:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return rules


def _layer_norm_rules(d: ResolvedModel, p: str) -> list[Rule]:
    """A layer's hidden-size norms: on the inputs of attention and MLP (saved under the
    TE-fused names), OLMo 2's on their outputs (``.post_norm`` of the output projections), or
    Gemma's on both sides (its ``post_attention_layernorm`` is after attention)."""
    if d.placement == NormPlacement.pre_post:
        return [Rule(L + "self_attention.linear_qkv.layer_norm_weight",
                     (p + "input_layernorm.weight",), "copy", 1),
                Rule(L + "self_attention.linear_proj.post_norm.weight",
                     (p + "post_attention_layernorm.weight",), "copy", 1),
                Rule(L + "mlp.linear_fc1.layer_norm_weight",
                     (p + "pre_feedforward_layernorm.weight",), "copy", 1),
                Rule(L + "mlp.linear_fc2.post_norm.weight",
                     (p + "post_feedforward_layernorm.weight",), "copy", 1)]
    if d.post_norm:
        return [Rule(L + "self_attention.linear_proj.post_norm.weight",
                     (p + "post_attention_layernorm.weight",), "copy", 1),
                Rule(L + "mlp.linear_fc2.post_norm.weight",
                     (p + "post_feedforward_layernorm.weight",), "copy", 1)]
    return [Rule(L + "self_attention.linear_qkv.layer_norm_weight",
                 (p + "input_layernorm.weight",), "copy", 1),
            Rule(L + "mlp.linear_fc1.layer_norm_weight",
                 (p + "post_attention_layernorm.weight",), "copy", 1)]


def _expert_rules(d: ResolvedModel, p: str) -> list[Rule]:
    """Router and experts: Mixtral's ``block_sparse_moe`` (w1, w3, w2), or Qwen3-MoE's ``mlp``
    (gate_proj, up_proj, down_proj per expert)."""
    if d.family == HfFamily.qwen3_moe:
        moe, (gate, up, down) = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    else:
        moe, (gate, up, down) = p + "block_sparse_moe.", ("w1", "w3", "w2")
    return [Rule(L + "mlp.router.weight", (moe + "gate.weight",), "copy", 1),
            Rule(EXPERTS + "linear_fc1.weight", (moe + f"experts.{{e}}.{gate}.weight",
                                                  moe + f"experts.{{e}}.{up}.weight"), "glu", 2),
            Rule(EXPERTS + "linear_fc2.weight", (moe + f"experts.{{e}}.{down}.weight",),
                 "copy", 2)]


def _qkv_rule(d: ResolvedModel, p: str) -> Rule:
    """The fused QKV weight: from q/k/v_proj, or Phi-3's one qkv_proj ([all q; all k; all v])."""
    if d.family == HfFamily.phi3:
        return Rule(L + "self_attention.linear_qkv.weight", (p + "self_attn.qkv_proj.weight",),
                    "qkv_fused", 1)
    return Rule(L + "self_attention.linear_qkv.weight",
                tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), "qkv", 1)


def _gpt2_rules(d: ResolvedModel) -> list[Rule]:
    p = "transformer.h.{l}."
    rules = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab", 0),
             Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",), "copy", 0)]
    per_layer = [("self_attention.linear_qkv.layer_norm_weight", "ln_1.weight", "copy"),
                 ("self_attention.linear_qkv.layer_norm_bias", "ln_1.bias", "copy"),
                 ("self_attention.linear_qkv.weight", "attn.c_attn.weight", "gpt2_qkv"),
                 ("self_attention.linear_qkv.bias", "attn.c_attn.bias", "gpt2_qkv_bias"),
                 ("self_attention.linear_proj.weight", "attn.c_proj.weight", "t"),
                 ("self_attention.linear_proj.bias", "attn.c_proj.bias", "copy"),
                 ("mlp.linear_fc1.layer_norm_weight", "ln_2.weight", "copy"),
                 ("mlp.linear_fc1.layer_norm_bias", "ln_2.bias", "copy"),
                 ("mlp.linear_fc1.weight", "mlp.c_fc.weight", "t"),
                 ("mlp.linear_fc1.bias", "mlp.c_fc.bias", "copy"),
                 ("mlp.linear_fc2.weight", "mlp.c_proj.weight", "t"),
                 ("mlp.linear_fc2.bias", "mlp.c_proj.bias", "copy")]
    rules += [Rule(L + key, (p + hf,), kind, 1) for key, hf, kind in per_layer]
    rules += [Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), "copy", 0),
              Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), "copy", 0)]
    return rules


def rules(d: ResolvedModel) -> list[Rule]:
    """Every tensor of the model, in HF file order (embedding, layers, final norm, output)."""
    if d.arch == "gpt2":
        return _gpt2_rules(d)
    return _deepseek_rules(d) if d.mla else _llama_rules(d)


def entries(d: ResolvedModel) -> Iterator[tuple[Rule, tuple]]:
    """(rule, index) for every canonical tensor, layer by layer (one layer's tensors together,
    so that a streaming reader or writer holds one layer at a time)."""
    all_rules = rules(d)
    for rule in all_rules:
        if rule.stacked == 0 and rule.key.startswith("embedding."):
            yield rule, ()
    for layer in range(d.layers):
        for rule in all_rules:
            if not _holds(rule, d, layer):
                continue
            if rule.stacked == 1:
                yield rule, (layer,)
            elif rule.stacked == 2:
                for expert in range(d.experts):
                    yield rule, (layer, expert)
    for rule in all_rules:
        if rule.stacked == 0 and not rule.key.startswith("embedding."):
            yield rule, ()


_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def stacked_address(key: str, index: tuple) -> tuple[str, tuple]:
    """(key, index) in model space for a dist-checkpointing key and its stacked offsets.
    Megatron-Core keys the layers of a model whose layers differ (``moe_layer_freq`` as a list:
    DeepSeek-V3's dense first layers) one by one (``decoder.layers.3.mlp.router.weight``); the
    layer number joins the index instead."""
    match = _PER_LAYER.match(key)
    if not match:
        return key, tuple(index)
    return L + match.group(2), (int(match.group(1)), *index)


def stored_key(key: str, index: tuple, d: ResolvedModel) -> tuple[str, tuple]:
    """The other way: where a torch_dist checkpoint of ``d`` keeps (key, index)."""
    if d.dense_layers and key.startswith(L) and index:
        return f"{L}{index[0]}.{key[len(L):]}", tuple(index[1:])
    return key, tuple(index)


def hf_names(rule: Rule, index: tuple) -> list[str]:
    fill = dict(zip("le", index))
    return [name.format(**fill) for name in rule.hf]


def by_key(d: ResolvedModel) -> dict[str, Rule]:
    return {rule.key: rule for rule in rules(d)}


def _qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: ResolvedModel) -> torch.Tensor:
    per = d.heads // d.groups
    tail = q.shape[1:]
    parts = (q.reshape(d.groups, per * d.head_dim, *tail), k.reshape(d.groups, d.head_dim, *tail),
             v.reshape(d.groups, d.head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _qkv_split(qkv: torch.Tensor, d: ResolvedModel) -> list[torch.Tensor]:
    per = d.heads // d.groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(d.groups, (per + 2) * d.head_dim, *tail)
    q, k, v = torch.split(grouped, [per * d.head_dim, d.head_dim, d.head_dim], dim=1)
    return [t.reshape(-1, *tail) for t in (q, k, v)]


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with ``rows`` rows: zero rows appended (vocabulary padding) or cut off; ``t``
    itself when it has that many (or ``rows`` is 0)."""
    if not rows or rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        return t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def to_canonical(rule: Rule, index: tuple, read: Callable[[str], torch.Tensor], d: ResolvedModel,
                 rows: int = 0) -> torch.Tensor:
    """The Megatron-Core tensor of ``rule`` at ``index`` from HF tensors (``read(name)``);
    ``rows``: the padded vocabulary for vocab tensors."""
    hf = [read(name) for name in hf_names(rule, index)]
    if rule.kind == "copy":
        return hf[0]
    if rule.kind == "vocab":
        return pad_rows(hf[0], rows)
    if rule.kind == "qkv":
        return _qkv_join(*hf, d)
    if rule.kind == "glu":
        return torch.cat(hf, dim=0)
    if rule.kind == "t":
        return hf[0].t().contiguous()
    if rule.kind == "gpt2_qkv":
        return _qkv_join(*[w.t() for w in torch.chunk(hf[0], 3, dim=1)], d).contiguous()
    if rule.kind == "gpt2_qkv_bias":
        return _qkv_join(*torch.chunk(hf[0], 3, dim=0), d)
    if rule.kind == "qkv_fused":
        return _qkv_join(*torch.split(hf[0], [d.q_dim, d.kv_dim, d.kv_dim], dim=0), d)
    raise ValueError(f"unknown mapping kind {rule.kind!r}")


def to_hf(rule: Rule, index: tuple, tensor: torch.Tensor, d: ResolvedModel) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors (name, tensor) of the Megatron-Core tensor of ``rule`` at ``index``."""
    names = hf_names(rule, index)
    if rule.kind == "copy":
        parts = [tensor]
    elif rule.kind == "vocab":
        parts = [tensor[:d.vocab]]
    elif rule.kind == "qkv":
        parts = _qkv_split(tensor, d)
    elif rule.kind == "glu":
        parts = list(torch.chunk(tensor, 2, dim=0))
    elif rule.kind == "t":
        parts = [tensor.t()]
    elif rule.kind == "gpt2_qkv":
        parts = [torch.cat([t.t() for t in _qkv_split(tensor, d)], dim=1)]
    elif rule.kind in ("gpt2_qkv_bias", "qkv_fused"):
        parts = [torch.cat(_qkv_split(tensor, d), dim=0)]
    else:
        raise ValueError(f"unknown mapping kind {rule.kind!r}")
    return [(name, part.contiguous()) for name, part in zip(names, parts)]
