"""Models in and out: tiny random transformers models (Llama with GQA, tied and untied, Llama 3.1
RoPE scaling; Mixtral with 4 experts top-2; GPT-2; Qwen2 with its QKV biases, tied and untied;
Qwen3 with QK-norm and a head dimension other than hidden / heads; Mistral with a sliding window
shorter than the prompt; Phi-3 with its fused projections and a window; Qwen3-MoE with 4 experts
top-2 weighted by the softmax over all experts; OLMo 2; Gemma 3; DeepSeek-V3 with multi-latent
attention, two dense layers then 8 experts with a shared one and a grouped sigmoid router with
its load-balancing bias)
imported at TP=1/TP=2/PP=2/EP=2 give the
logits of transformers within 1e-4 (fp32); greedy generation equals transformers'; import ->
export through both engines gives identical tensors; a trained checkpoint exports to a
directory AutoModelForCausalLM loads with our logits; a model that disagrees with the weights
exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.dist import REPO_ROOT, run_distributed

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
             rope_theta=500000.0, initializer_range=0.2)
MISTRAL_WINDOW = 4
"""Shorter than PROMPT: its later tokens attend to 4 of the 8."""
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _save(model, path: Path) -> str:
    model.save_pretrained(str(path))
    return str(path)


def _random_constants(model):
    """Biases and norm weights drawn at random: transformers starts them at 0 and 1, which a
    wrong mapping of them (a swapped norm, a misplaced bias) would leave unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict:
    """Tiny random HF models saved to disk, by name."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    t = transformers
    llama = t.LlamaConfig(**LLAMA, tie_word_embeddings=True, rope_scaling=LLAMA31_ROPE)
    untied = t.LlamaConfig(**{**LLAMA, "num_hidden_layers": 4}, tie_word_embeddings=False)
    mixtral = t.MixtralConfig(**{**LLAMA, "max_position_embeddings": 4096}, num_local_experts=4,
                              num_experts_per_tok=2, tie_word_embeddings=False)
    gpt2 = t.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                        initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    models = {"llama31_tied": _save(t.LlamaForCausalLM(llama), root / "llama31_tied"),
              "llama_untied": _save(t.LlamaForCausalLM(untied), root / "llama_untied"),
              "mixtral": _save(t.MixtralForCausalLM(mixtral), root / "mixtral"),
              "gpt2": _save(t.GPT2LMHeadModel(gpt2), root / "gpt2")}
    qwen2 = t.Qwen2Config(**LLAMA, tie_word_embeddings=True)
    qwen2_untied = t.Qwen2Config(**{**LLAMA, "num_hidden_layers": 4}, tie_word_embeddings=False)
    models["qwen2"] = _save(_random_constants(t.Qwen2ForCausalLM(qwen2)), root / "qwen2")
    models["qwen2_untied"] = _save(_random_constants(t.Qwen2ForCausalLM(qwen2_untied)),
                                   root / "qwen2_untied")
    qwen3 = t.Qwen3Config(**{**LLAMA, "num_hidden_layers": 4}, head_dim=32,
                          tie_word_embeddings=False)
    models["qwen3"] = _save(_random_constants(t.Qwen3ForCausalLM(qwen3)), root / "qwen3")
    mistral = t.MistralConfig(**{**LLAMA, "num_hidden_layers": 4}, head_dim=16,
                              sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False)
    models["mistral"] = _save(_random_constants(t.MistralForCausalLM(mistral)), root / "mistral")
    phi3 = t.Phi3Config(**LLAMA, sliding_window=MISTRAL_WINDOW, pad_token_id=0, eos_token_id=0,
                        bos_token_id=0, tie_word_embeddings=False)
    models["phi3"] = _save(_random_constants(t.Phi3ForCausalLM(phi3)), root / "phi3")
    qwen3_moe = t.Qwen3MoeConfig(**{**LLAMA, "max_position_embeddings": 4096}, head_dim=16,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=False, tie_word_embeddings=False)
    models["qwen3_moe"] = _save(_random_constants(t.Qwen3MoeForCausalLM(qwen3_moe)),
                                root / "qwen3_moe")
    olmo2 = t.Olmo2Config(**{**LLAMA, "num_hidden_layers": 4}, pad_token_id=0, eos_token_id=0,
                          tie_word_embeddings=False)
    models["olmo2"] = _save(_random_constants(t.Olmo2ForCausalLM(olmo2)), root / "olmo2")
    models["gemma3"] = _save(_random_constants(t.Gemma3ForCausalLM(GEMMA3(t))), root / "gemma3")
    models["deepseek_v3"] = _save(_random_router_bias(_random_constants(
        t.DeepseekV3ForCausalLM(DEEPSEEK_V3(t)))), root / "deepseek_v3")
    vision = t.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, image_size=28, patch_size=14)
    multimodal = t.Gemma3Config(text_config=GEMMA3(t).to_dict(), vision_config=vision.to_dict(),
                                mm_tokens_per_image=4)
    models["gemma3_multimodal"] = _save(
        _random_constants(t.Gemma3ForConditionalGeneration(multimodal)), root / "gemma3_mm")
    return models


def DEEPSEEK_V3(t):
    """Every DeepSeek-V3 feature on: two dense layers, then two of 8 experts (top 4 of 2 of 4
    groups, weights x 2.5) with a shared expert; query and key/value latents, a value width
    other than the key's; YaRN (factor 40, as published, over a 64-token original context, and
    an mscale_all_dim other than mscale, so that both the cos/sin magnitude and the attention
    scale change)."""
    return t.DeepseekV3Config(
        **{**LLAMA, "num_hidden_layers": 4, "max_position_embeddings": 4096,
           "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=2, routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        eos_token_id=None)  # its default, 1, would end transformers' greedy output early


def _random_router_bias(model):
    """DeepSeek-V3's load-balancing bias (a buffer, zero in a new model) drawn at random, so
    that it changes which experts are chosen."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    return model


def GEMMA3(t):
    """Every Gemma 3 feature on: windowed layers 1 and 3 (RoPE base 10,000) between full ones
    (base 1e6, linear scaling 8), an attention scale other than the head dimension's."""
    return t.Gemma3TextConfig(
        **{**LLAMA, "num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=MISTRAL_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def reference_logits(path: str, ids=PROMPT) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def layout_worker(args: dict) -> dict:
    """Build each family's model at one layout in turn (one launch for them all), fill it from
    its HF directory; return, from the last pipeline stage (None elsewhere), name -> {"logits":
    the prompt's, "generated": greedy new tokens when asked} or {"error": the traceback}."""
    import dataclasses
    import traceback

    from launcher.config import ParallelismConfig
    from launcher.engines.model import init_parallel_state

    init_parallel_state(dataclasses.replace(ParallelismConfig(), **args["parallelism"]))
    results = {}
    for name, path in args["models"].items():
        try:
            results[name] = _family_at_layout(path, args["parallelism"], args["generate"])
        except Exception:  # the family's tests fail with it; the other families still run
            results[name] = {"error": traceback.format_exc()}
    return results


def _family_at_layout(path: str, parallelism: dict, new_tokens: int) -> dict | None:
    import dataclasses

    from launcher.config import (GenerateConfig, ModelConfig, ParallelismConfig, Precision,
                                 TrainerConfig)
    from launcher.engines.megatron.engine import build_model_chunks
    from launcher.engines.megatron.generation import Generator
    from launcher.engines.weights.fill import fill_chunks
    from launcher.launch.model_source import source_model

    model = ModelConfig(**{**source_model(path), "seq_length": 64})
    chunks = build_model_chunks(model, dataclasses.replace(ParallelismConfig(), **parallelism),
                                TrainerConfig(precision=Precision.fp32))
    fill_chunks(chunks, path)
    generator = Generator(chunks, vocab_size=model.vocab_size)
    with torch.no_grad():
        new, logits = generator.generate(PROMPT, GenerateConfig(max_new_tokens=new_tokens))
    if logits is None:
        return None
    return {"logits": logits.tolist(), "generated": new}


LAYOUTS = {"tp1": ({}, 1), "tp2": ({"tensor_parallel_size": 2}, 2),
           "pp2": ({"pipeline_parallel_size": 2}, 2),
           "ep2": ({"expert_parallel_size": 2}, 2)}
GENERATED_TOKENS = 32
"""Greedy tokens generated at TP=2 (and compared with transformers'); none at other layouts."""
FAMILIES_AT = {
    "tp1": ["llama31_tied", "mixtral", "gpt2", "qwen2", "qwen3", "mistral", "phi3",
            "qwen3_moe", "olmo2", "gemma3", "deepseek_v3"],
    "tp2": ["llama31_tied", "llama_untied", "mixtral", "gpt2", "qwen2", "qwen3", "mistral",
            "phi3", "qwen3_moe", "olmo2", "gemma3", "gemma3_multimodal", "deepseek_v3"],
    "pp2": ["llama_untied", "mixtral", "gpt2", "qwen2_untied", "qwen3", "mistral", "phi3",
            "qwen3_moe", "olmo2", "gemma3", "deepseek_v3"],
    "ep2": ["mixtral", "qwen3_moe", "deepseek_v3"]}
"""Which families each layout imports: every family at TP=1, TP=2 and PP=2 (the untied
variant where a family has one, at PP=2, whose last stage then holds its own output layer),
the MoE families at EP=2."""


@pytest.fixture(scope="module")
def layout_outputs(hf_models):
    """layout -> family -> {"logits", "generated"}: one launch a layout, on first use. The
    tests of a layout share an xdist group, so one worker launches it."""
    cache = {}

    def outputs(layout: str) -> dict:
        if layout not in cache:
            try:
                cache[layout] = _launch_layout(hf_models, layout)
            except Exception as exc:  # a launch that failed or hung fails its tests once
                cache[layout] = exc
        if isinstance(cache[layout], Exception):
            raise cache[layout]
        return cache[layout]
    return outputs


def _launch_layout(hf_models: dict, layout: str) -> dict:
    parallelism, ranks = LAYOUTS[layout]
    models = {name: hf_models[name] for name in FAMILIES_AT[layout]}
    results = run_distributed("tests.test_convert_hf:layout_worker", ranks,
                              {"models": models, "parallelism": parallelism,
                               "generate": GENERATED_TOKENS if layout == "tp2" else 1},
                              timeout=600)
    return {name: next(r[name] for r in results if r[name] is not None) for name in models}


def _family_output(layout_outputs, layout: str, name: str) -> dict:
    out = layout_outputs(layout)[name]
    assert "error" not in out, out.get("error")
    return out


def _at(layout: str, names: list) -> list:
    return [pytest.param(name, layout, marks=pytest.mark.xdist_group(f"convert_hf_{layout}"))
            for name in names]


@pytest.mark.parametrize("name,layout", [
    param for layout, names in FAMILIES_AT.items() for param in _at(layout, names)])
def test_imported_logits_equal_transformers(layout_outputs, hf_models, name, layout,
                                            record_property):
    """The largest difference is recorded (``--junitxml``: docs/convert.md's table)."""
    ours = np.array(_family_output(layout_outputs, layout, name)["logits"])
    ref = reference_logits(hf_models[name])
    assert ours.shape == ref.shape
    record_property("max_abs_logit_diff", float(np.abs(ours - ref).max()))
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()


def test_rope_scaling_is_applied(hf_models, tmp_path):
    """Control for the test above: the same weights without the Llama 3.1 scaling in the
    config give other logits, so equality there checks the scaling."""
    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads(Path(hf_models["llama31_tied"], "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (plain / "config.json").write_text(json.dumps(config))
    os.symlink(Path(hf_models["llama31_tied"], "model.safetensors"), plain / "model.safetensors")
    assert np.abs(reference_logits(str(plain)) - reference_logits(hf_models["llama31_tied"])
                  ).max() > 1e-3


def _cli(module: str, *args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _hf_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _same_tensors(a: str, b: str) -> None:
    ta, tb = _hf_tensors(a), _hf_tensors(b)
    assert sorted(ta) == sorted(tb)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


@pytest.mark.parametrize("name,layout", [
    ("llama31_tied", ["engine=deepspeed", "parallelism.zero_stage=1"]),
    ("llama_untied", ["engine=deepspeed", "parallelism.zero_stage=3"]),
    ("mixtral", ["engine=megatron", "parallelism.expert_parallel_size=2"]),
    ("gpt2", ["engine=megatron", "parallelism.tensor_parallel_size=2",
              "parallelism.zero_stage=0"]),
    # DeepSpeed at TP=2: the shards merge as the writer recorded their split (SwiGLU included)
    ("llama_untied", ["engine=deepspeed", "parallelism.tensor_parallel_size=2"]),
    ("mixtral", ["engine=deepspeed", "parallelism.tensor_parallel_size=2"]),
    ("llama31_tied", ["engine=deepspeed", "parallelism.tensor_parallel_size=2",
                      "parallelism.zero_stage=3"]),
    ("qwen2", ["engine=megatron", "parallelism.tensor_parallel_size=2"]),
    ("qwen2_untied", ["engine=deepspeed", "parallelism.tensor_parallel_size=2"]),
    # one round trip a family where its tensors add nothing per engine (CI time): Qwen3's
    # per-head QK norms go through Megatron at PP=2 with Gemma 3's, Phi-3's fused projections
    # are converted to and from the same model space by either engine
    ("qwen3", ["engine=deepspeed", "parallelism.tensor_parallel_size=2"]),
    ("mistral", ["engine=megatron", "parallelism.tensor_parallel_size=2"]),
    ("phi3", ["engine=megatron", "parallelism.tensor_parallel_size=2"]),
    ("qwen3_moe", ["engine=megatron", "parallelism.expert_parallel_size=2"]),
    ("olmo2", ["engine=megatron", "parallelism.tensor_parallel_size=2"]),
    ("olmo2", ["engine=deepspeed", "parallelism.tensor_parallel_size=2"]),
    ("gemma3", ["engine=megatron", "parallelism.pipeline_parallel_size=2"]),
    ("gemma3", ["engine=deepspeed", "parallelism.tensor_parallel_size=2"]),
    # DeepSeek-V3's per-layer keys (dense then MoE layers) through torch_dist, its replicated
    # down-projection and TP-split up-projections under SP (engine=deepspeed refuses its bias)
    ("deepseek_v3", ["engine=megatron", "parallelism.tensor_parallel_size=2",
                     "parallelism.sequence_parallel=true"])])
def test_import_export_round_trip_is_identical(hf_models, tmp_path, name, layout):
    run, out = tmp_path / "run", tmp_path / "hf_out"
    imported = _cli("launcher.convert", "from_hf", f"hf={hf_models[name]}", f"out={run}",
                    "trainer.precision=fp32", "model.seq_length=64", *layout)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert (run / "checkpoints" / "step_000000" / "complete").exists()
    exported = _cli("launcher.convert", "to_hf", f"checkpoint={run}", f"out={out}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    _same_tensors(hf_models[name], str(out))


def test_a_multimodal_gemma3_exports_its_language_model(hf_models, tmp_path):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration: the language model (under
    ``language_model.``) is imported, the vision encoder left; the export is the language model
    as a Gemma3ForCausalLM, its tensors those of the original bitwise."""
    run, out = tmp_path / "run", tmp_path / "hf_out"
    imported = _cli("launcher.convert", "from_hf", f"hf={hf_models['gemma3_multimodal']}",
                    f"out={run}", "engine=megatron", "parallelism.tensor_parallel_size=2",
                    "cluster.gpus_per_node=2", "trainer.precision=fp32")
    assert imported.returncode == 0, imported.stderr[-3000:]
    exported = _cli("launcher.convert", "to_hf", f"checkpoint={run}", f"out={out}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    original, ours = _hf_tensors(hf_models["gemma3_multimodal"]), _hf_tensors(str(out))
    language = {k[len("language_model."):]: v for k, v in original.items()
                if k.startswith("language_model.")}
    assert len(language) < len(original) and sorted(language) == sorted(ours)
    assert all(torch.equal(language[k], ours[k]) for k in ours)
    config = transformers.AutoConfig.from_pretrained(str(out))
    assert config.model_type == "gemma3_text" and config.layer_types[1] == "full_attention"


@pytest.mark.parametrize("name,layout", _at("tp2", [
    "llama_untied", "mixtral", "gpt2", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe", "olmo2",
    "gemma3", "deepseek_v3"]))
def test_generate_at_tp2_equals_transformers_greedy(layout_outputs, hf_models, name, layout):
    """launcher.generate's decoding (its Generator, on the chunks it builds and fills) at TP=2;
    the command itself is run by the DeepSpeed import test below."""
    path = hf_models[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=GENERATED_TOKENS,
                              do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert len(set(expected)) > 3  # a prompt that really tests the decoding
    assert _family_output(layout_outputs, layout, name)["generated"] == expected


@pytest.mark.parametrize("tp", [2, 1])
def test_a_deepspeed_tp2_import_generates_at_any_layout(hf_models, tmp_path, tp):
    """The default engine's checkpoint at TP=2 (launcher.convert from_hf) is read by generate at
    TP=2 and at TP=1, which decode as transformers does."""
    path = hf_models["llama_untied"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    run = tmp_path / "ck"
    imported = _cli("launcher.convert", "from_hf", f"hf={path}", f"out={run}",
                    "trainer.precision=fp32", "model.seq_length=64",
                    "parallelism.tensor_parallel_size=2", "cluster.gpus_per_node=2")
    assert imported.returncode == 0, imported.stderr[-3000:]
    result = _cli("launcher.generate", f"checkpoint={run}", f"generate.prompt_ids={PROMPT}",
                  "generate.max_new_tokens=8", "generate.format=json", "trainer.precision=fp32",
                  f"parallelism.tensor_parallel_size={tp}", f"cluster.gpus_per_node={tp}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["output_ids"] == expected


def test_trained_checkpoint_exports_to_transformers_with_our_logits(hf_models, tmp_path):
    """init_from an HF model, train 3 steps (engine=megatron, PP=2), export: transformers loads
    it and its logits equal launcher.generate's on the trained checkpoint."""
    run = tmp_path / "runs"
    trained = _cli("launcher.train", f"trainer.init_from={hf_models['llama_untied']}",
                   "engine=megatron", "parallelism.pipeline_parallel_size=2",
                   "trainer.precision=fp32", "model.seq_length=64", "trainer.train_steps=3",
                   "optimizer.warmup_steps=0", "data.num_workers=0", f"run.output_root={run}",
                   "run.name=ft")
    assert trained.returncode == 0, trained.stderr[-3000:]
    events = (run / "ft" / "events.jsonl").read_text()
    assert "init_from" in events
    out = tmp_path / "hf_out"
    assert _cli("launcher.convert", "to_hf", f"checkpoint={run / 'ft'}",
                f"out={out}").returncode == 0
    logits_file = tmp_path / "ours.npy"
    gen = _cli("launcher.generate", f"checkpoint={run / 'ft'}", f"generate.prompt_ids={PROMPT}",
               "generate.max_new_tokens=0", f"generate.logits_file={logits_file}",
               "trainer.precision=fp32", "cluster.gpus_per_node=1")
    assert gen.returncode == 0, gen.stderr[-3000:]
    ours, theirs = np.load(logits_file), reference_logits(str(out))
    assert np.abs(ours - theirs).max() < 1e-4
    assert np.abs(theirs - reference_logits(hf_models["llama_untied"])).max() > 1e-4  # trained


def test_a_model_that_disagrees_with_the_weights_exits_2(hf_models, tmp_path):
    result = _cli("launcher.train", f"trainer.init_from={hf_models['llama31_tied']}",
                  "model=tiny", f"run.output_root={tmp_path}")
    assert result.returncode == 2
    assert "model.hidden_size: weights 64, config 256 (set model.hidden_size=64)" in result.stderr
    assert "model.num_layers: weights 2, config 4" in result.stderr


def test_unsupported_hf_features_exit_2_naming_each(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 300,
              "sliding_window": 4096, "hidden_act": "gelu",
              "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = _cli("launcher.convert", "preset", f"hf={tmp_path}")
    assert result.returncode == 2
    for fragment in ("rope type 'yarn'", "sliding_window=4096", "hidden_act='gelu'"):
        assert fragment in result.stderr


def test_preset_prints_a_model_that_composes(hf_models, tmp_path):
    import yaml

    from launcher.compose import compose_config, to_object

    result = _cli("launcher.convert", "preset", f"hf={hf_models['llama31_tied']}")
    assert result.returncode == 0, result.stderr
    fields = yaml.safe_load(result.stdout)
    assert fields["rope_scaling"] == "llama3" and fields["rope_scaling_factor"] == 8.0
    assert fields["num_query_groups"] == 2 and fields["untie_embeddings_and_output_weights"] is False
    cfg = to_object(compose_config([f"model.{k}={v}" for k, v in fields.items()]))
    assert cfg.model.seq_length == 8192 and cfg.model.max_position_embeddings == 131072


@pytest.mark.parametrize("name", ["qwen2", "qwen2_untied", "qwen3", "mistral", "phi3",
                                  "qwen3_moe", "olmo2", "gemma3", "llama31_tied", "mixtral",
                                  "gpt2", "deepseek_v3"])
def test_the_plan_counts_the_parameters_transformers_counts(hf_models, name):
    """The plan's published figure (no vocabulary padding) of the imported config equals
    num_parameters() of the transformers model."""
    from launcher.config import ModelConfig
    from launcher.launch.model_source import source_model
    from launcher.plan.params import count_parameters

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models[name])
    ours = count_parameters(ModelConfig(**source_model(hf_models[name])))
    assert ours.total_unpadded == model.num_parameters()


def test_the_deepseek_router_bias_changes_the_choice_of_experts(hf_models, tmp_path):
    """Control for the logits test: without its load-balancing bias the same DeepSeek-V3 gives
    other logits, so equality there checks that the bias chooses the experts."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["deepseek_v3"],
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
        unbiased = model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(unbiased - reference_logits(hf_models["deepseek_v3"])).max() > 1e-3


def test_the_deepseek_yarn_changes_the_logits(hf_models, tmp_path):
    """Control for the logits test: the same DeepSeek-V3 weights with plain RoPE give other
    logits, so equality there checks YaRN (frequencies, magnitude and attention scale)."""
    import shutil

    plain = tmp_path / "plain_rope"
    shutil.copytree(hf_models["deepseek_v3"], plain)
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config.pop("rope_scaling", None)
    (plain / "config.json").write_text(json.dumps(config))
    difference = np.abs(reference_logits(str(plain)) - reference_logits(hf_models["deepseek_v3"]))
    assert difference.max() > 1e-3


def _with_extra_layer(src: str, dst: Path) -> None:
    """A copy of the HF directory ``src`` with a multi-token-prediction layer's tensor
    (``model.layers.<num_hidden_layers>.*``) added, as DeepSeek-V3's published weights have."""
    from safetensors.torch import save_file

    dst.mkdir()
    config = json.loads((Path(src) / "config.json").read_text())
    tensors = _hf_tensors(src)
    tensors[f"model.layers.{config['num_hidden_layers']}.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def test_multi_token_prediction_weights_are_refused_before_any_rank_starts(hf_models, tmp_path):
    hf = tmp_path / "with_mtp"
    _with_extra_layer(hf_models["deepseek_v3"], hf)
    result = _cli("launcher.convert", "from_hf", f"hf={hf}", f"out={tmp_path / 'run'}",
                  "trainer.precision=fp32", "model.seq_length=64")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model.layers.4" in result.stderr and "multi-token-prediction" in result.stderr
    assert "rank" not in result.stdout.lower() and not (tmp_path / "run").exists()


def test_quantized_deepseek_weights_are_refused_naming_the_fix(tmp_path):
    config = DEEPSEEK_V3(transformers).to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = _cli("launcher.convert", "preset", f"hf={tmp_path}")
    assert result.returncode == 2
    assert "quant_method='fp8'" in result.stderr and "dequantize" in result.stderr


def test_yarn_settings_megatron_reads_otherwise_are_refused(tmp_path):
    """transformers ignores mscale without mscale_all_dim and does not truncate with
    truncate=false; Megatron-Core would build another model: both are refused, named."""
    config = DEEPSEEK_V3(transformers).to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "mscale": 0.9,
                                 "truncate": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = _cli("launcher.convert", "preset", f"hf={tmp_path}")
    assert result.returncode == 2
    assert "mscale=0.9 with mscale_all_dim=None" in result.stderr
    assert "rope_scaling.truncate=False" in result.stderr


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """A BPE trained here holding every shipped template's special tokens (vocabulary < 300,
    the test models')."""
    from tokenizers import Tokenizer

    from launcher.core.chat_render import TEMPLATE_TOKENS
    from tests.helpers.chat import chatml_tokenizer

    directory = chatml_tokenizer(tmp_path_factory.mktemp("chat_tok"), 270)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(sorted({t for ts in TEMPLATE_TOKENS.values() for t in ts}))
    tokenizer.save(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= 300
    return directory


@pytest.mark.parametrize("name", ["llama_untied", "qwen2", "mixtral", "phi3", "olmo2", "gemma3",
                                  "deepseek_v3"])
def test_one_fine_tuning_step_on_the_familys_own_chat_format_at_tp2(hf_models, chat_tokenizer,
                                                                    tmp_path, name):
    """Conversations rendered in the family's instruct format (FAMILY_TEMPLATES) and packed,
    then one step at TP=2 from the family's weights (experts with sequence parallelism, which
    Megatron-Core trains them with; Phi-3's and Gemma 3's windows over packed rows)."""
    from launcher.core.chat_render import FAMILY_TEMPLATES
    from tests.helpers.chat import conversations

    family = json.loads((Path(hf_models[name]) / "config.json").read_text())["model_type"]
    template = FAMILY_TEMPLATES["gemma3_text" if family == "gemma3_text" else family]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in
                                                       conversations(40)) + "\n")
    prepared = _cli("data_prep", f"input={tmp_path / 'in'}", f"output={tmp_path / 'chat'}",
                    "format=chat", "tokenizer.kind=hf", f"tokenizer.path={chat_tokenizer}",
                    f"chat.template={template}", "seq_length=64", "progress=false",
                    "split='100,0,0'")
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    moe = ["parallelism.sequence_parallel=true"] if name in ("mixtral", "deepseek_v3") else []
    trained = _cli("launcher.train", f"trainer.init_from={hf_models[name]}", "engine=megatron",
                   "trainer.precision=fp32", "model.seq_length=64", "trainer.train_steps=1",
                   "optimizer.warmup_steps=0", "data.num_workers=0",
                   "parallelism.tensor_parallel_size=2", "cluster.gpus_per_node=2", *moe,
                   f"hydra.searchpath=[file://{tmp_path / 'chat' / 'conf'}]", "data=chat",
                   f"run.output_root={tmp_path}", "run.name=ft", "run.report=false",
                   "logger=none")
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    manifest = json.loads((tmp_path / "chat" / "manifest.json").read_text())
    assert manifest["chat"]["template"] == template
    [step] = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").open()
              if '"loss"' in line]
    assert step["step"] == 1 and np.isfinite(step["loss"]) and step["target_tokens"] > 0


def test_a_qwen2_with_sliding_windows_is_refused_naming_the_setting(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 300,
              "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = _cli("launcher.convert", "preset", f"hf={tmp_path}")
    assert result.returncode == 2
    assert "use_sliding_window=true" in result.stderr and "sliding_window=32" in result.stderr


def test_export_refuses_a_model_no_family_holds_before_writing():
    """A Llama with biases on every linear layer, or QKV biases with experts: no Hugging Face
    family has them (before, the export wrote a Llama config without the biases)."""
    from launcher.engines.weights.hf_config import UnsupportedModel
    from launcher.engines.weights.hf_export import export_problems, hf_config

    assert export_problems({"arch": "llama", "add_qkv_bias": True}) == []
    assert export_problems({"arch": "llama", "add_bias_linear": True}) == [
        "model.add_bias_linear has no place in llama (Hugging Face's LlamaForCausalLM has none)"]
    moe = {"arch": "llama", "add_qkv_bias": True, "num_experts": 4}
    assert export_problems(moe) == ["model.add_qkv_bias has no place in mixtral (Hugging "
                                    "Face's MixtralForCausalLM has none)"]
    assert export_problems({"arch": "llama", "hf_family": "qwen2"}) == [
        "model.hf_family=qwen2 needs model.add_qkv_bias"]
    with pytest.raises(UnsupportedModel, match="add_qkv_bias"):
        hf_config({**moe, "name": "m"}, dtype="float32")


def test_the_mistral_window_changes_the_logits(hf_models, tmp_path):
    """The sliding window really acts on PROMPT (so the Mistral tests above test it): the same
    weights without it give other logits."""
    full = tmp_path / "full"
    full.mkdir()
    config = json.loads(Path(hf_models["mistral"], "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    os.symlink(Path(hf_models["mistral"], "model.safetensors"), full / "model.safetensors")
    assert np.abs(reference_logits(str(full)) - reference_logits(hf_models["mistral"])).max() > 1e-3


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_from_hf_keeps_the_tokenizer_so_generate_and_evaluate_need_none(tmp_path):
    """A Llama directory with its tokenizer and chat template: from_hf keeps them in the step
    directory; launcher.generate generate.chat=true renders the prompt as transformers does and
    launcher.evaluate scores as with eval.tokenizer given, neither told where a tokenizer is."""
    import shutil

    from tests.helpers.chat import chatml_tokenizer

    tok = chatml_tokenizer(tmp_path / "tok", 280)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, "vocab_size": 300},
                                                           tie_word_embeddings=False)
                                  ).save_pretrained(str(hf))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, hf / name)
    run = tmp_path / "run"
    done = _cli("launcher.convert", "from_hf", f"hf={hf}", f"out={run}", "model.seq_length=64",
                "trainer.precision=fp32", "cluster.gpus_per_node=1")
    assert done.returncode == 0, done.stderr[-3000:]
    kept = run / "checkpoints" / "step_000000" / "tokenizer"
    assert sorted(p.name for p in kept.iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]

    turn = [{"role": "user", "content": "the cat sat"}]
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf))
    prompt = theirs.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    expected = theirs(prompt, add_special_tokens=False)["input_ids"]
    gen = _cli("launcher.generate", f"checkpoint={run}", "generate.chat=true",
               "generate.prompt=the cat sat", "generate.max_new_tokens=2", "generate.format=json",
               "trainer.precision=fp32", "cluster.gpus_per_node=1")
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert json.loads(gen.stdout.strip().splitlines()[-1])["prompt_ids"] == list(expected)

    scores = []
    for extra in ([], [f"eval.tokenizer={hf / 'tokenizer.json'}"]):
        ev = _cli("launcher.evaluate", f"checkpoint={run}", "eval.tasks=[tw_facts]",
                  "eval.limit=2", "eval.format=json", "cluster.gpus_per_node=1", *extra)
        assert ev.returncode == 0, ev.stderr[-3000:]
        scores.append(json.loads(ev.stdout.strip().splitlines()[-1])["tasks"])
    assert scores[0] == scores[1]
