"""Fine-tuning on packed conversations (issue 38, data.format=chat): a row keeps its
conversations apart (positions restart, attention cut, no label across a boundary), so a
conversation packed after another gives the logits and the summed loss it gives alone (RoPE and
learned positions); the per-token loss and gradients are the same for micro-batch 1 x 8
accumulations, 8 x 1 and DP2, with a micro-batch that holds no target token; a resumed epoch sees
every row once; engine=deepspeed and mock data are refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launcher.config import Arch, ParallelismConfig
from launcher.engines.packed_rows import attention_cut
from launcher.runtime.chat_data import PackedChatDataset, packed_sample
from tests.helpers.chat import split_rows, write_chat_shards
from tests.helpers.dist import gloo_group
from tests.helpers.models import build, in_process, small
from tests.helpers.training import REPO, TINY, train


def test_a_packed_row_keeps_its_conversations_apart():
    ids = np.array([10, 11, 12, 20, 21, 22, 23], dtype=np.int64)
    mask = np.array([0, 1, 1, 0, 0, 1, 1], dtype=np.uint8)
    seg = np.array([0, 0, 0, 1, 1, 1, 1])
    s = packed_sample(ids, mask, seg, seq_length=8, pad_id=0)
    assert s["tokens"].tolist() == [10, 11, 12, 20, 21, 22, 23, 0]
    assert s["labels"].tolist() == [11, 12, 20, 21, 22, 23, 0, 0]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    # label 20 starts the second conversation: never predicted from the first; padding untrained
    assert s["loss_mask"].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert s["segment_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    cut = attention_cut(s["segment_ids"][None])[0, 0]
    assert cut.shape == (8, 8)
    assert not cut[5, 3] and cut[5, 2] and cut[3, 4]  # within, across, the future
    assert not cut[7, 7] and cut[7, 6]  # padding attends to itself only


def test_a_sample_is_linear_in_the_sequence_not_an_s_by_s_mask():
    """At 32K tokens a row's sample is about 1.2 MiB (no [s, s] mask: 1 GiB of booleans); the
    mask the local attention needs is built per micro-batch on the device instead."""
    s = 32768
    seg = np.repeat(np.arange(8), s // 8 + 1)[:s + 1]
    sample = packed_sample(np.arange(s + 1) % 97, np.ones(s + 1, np.uint8), seg, s, pad_id=0)
    assert max(v.numel() for v in sample.values()) <= s
    assert sum(v.numel() * v.element_size() for v in sample.values()) < 16 * 2 ** 20


def test_a_micro_batch_of_rows_becomes_one_thd_sequence_that_attends_where_the_mask_does():
    """Under Transformer Engine the rows go as one packed sequence with cu_seqlens: the
    attention this allows (causal within each sequence) is exactly the rows' own mask, and the
    flattened loss mask keeps every target."""
    import torch

    from launcher.engines.packed_rows import to_thd

    rng = np.random.default_rng(4)
    rows = []
    for lengths in ([3, 4], [9], [2, 2, 3]):  # padded to 10 tokens each
        seg = np.concatenate([np.full(n, k) for k, n in enumerate(lengths)])
        ids = rng.integers(1, 99, len(seg))
        rows.append(packed_sample(ids, (rng.random(len(seg)) < .7).astype(np.uint8), seg, 10, 0))
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    flat, params = to_thd(batch)
    assert set(flat) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert all(v.shape == (1, 30) for v in flat.values())
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 10, 19, 20, 22, 24, 27, 30]
    assert params.max_seqlen_q == params.max_seqlen_kv == 9
    cu = params.cu_seqlens_q.tolist()
    sequence = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
    allowed = (sequence[:, None] == sequence[None, :]) & np.tril(np.ones((30, 30), bool))
    for r, row in enumerate(rows):
        block = allowed[10 * r:10 * r + 10, 10 * r:10 * r + 10]
        assert (block == ~attention_cut(row["segment_ids"][None])[0, 0].numpy()).all(), r
    assert float(flat["loss_mask"].sum()) == float(batch["loss_mask"].sum())
    assert torch.equal(flat["labels"][0], batch["labels"].reshape(-1))


def test_rows_packed_at_a_multiple_are_padded_for_context_parallelism():
    """CP=2 under TE: every conversation moves to an offset that is a multiple of 2 x CP = 4
    (cu_seqlens_padded), keeping its tokens, labels and loss mask (cu_seqlens: its real
    length); the row's padding takes what is left; a row packed without room is refused with
    the data_prep setting that makes room."""
    import torch

    from launcher.engines.packed_rows import UnpaddableRow, to_thd

    def row(lengths, s=16):
        seg = np.concatenate([np.full(n, k) for k, n in enumerate(lengths)])
        ids = np.arange(1, len(seg) + 1)
        return packed_sample(ids, np.ones(len(seg), np.uint8), seg, s, 0)

    rows = [row([3, 6]), row([8, 8])]  # at a multiple of 4: 4 + 8 <= 16 and 8 + 8 <= 16
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    flat, params = to_thd(batch, multiple=4)
    assert params.cu_seqlens_q.tolist() == [0, 3, 9, 13, 21, 29]  # real: 3, 6, padding 4; 8, 8
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12, 16, 24, 32]
    assert params.max_seqlen_q == 8 and flat["tokens"].shape == (1, 32)
    real, padded = params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded.tolist()
    offsets = [0, 3, 9, 16, 24]  # where each sequence starts in the unpadded rows
    for i, start in enumerate(offsets):
        n = real[i + 1] - real[i]
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(flat[key][0, padded[i]:padded[i] + n],
                               batch[key].reshape(-1)[start:start + n]), (key, i)
        assert flat["loss_mask"][0, padded[i] + n:padded[i + 1]].sum() == 0
    assert flat["loss_mask"].sum() == batch["loss_mask"].sum()
    with pytest.raises(UnpaddableRow, match="chat.pack_multiple=4"):
        to_thd({k: v[None] for k, v in row([3, 3, 9]).items()}, multiple=4)  # 4 + 4 + 9 > 16


def test_context_parallel_chat_needs_shards_packed_at_its_multiple(tmp_path):
    from launcher.compose import compose_config, to_object
    from launcher.plan import PlanError, compute_plan

    data = write_chat_shards(tmp_path / "data", split_rows())
    overrides = [*TINY, "engine=megatron", "data=chat", "parallelism.context_parallel_size=2",
                 f"hydra.searchpath=[file://{data / 'conf'}]"]
    for multiple, refused in ((1, True), (2, True), (4, False), (8, False)):
        (data / "manifest.json").write_text(json.dumps(
            {"format": "chat", "chat": {"pack_multiple": multiple}}))
        cfg = to_object(compose_config(overrides))
        if refused:
            with pytest.raises(PlanError, match="chat.pack_multiple=4"):
                compute_plan(cfg)
        else:
            compute_plan(cfg)


@pytest.fixture(scope="module")
def megatron_tp1():
    with gloo_group():
        from launcher.engines.model import init_parallel_state

        init_parallel_state(ParallelismConfig(), seed=1234)
        yield


def forward(gpt, sample: dict):
    import torch

    with torch.no_grad():
        logits = gpt(sample["tokens"][None], sample["position_ids"][None],
                     attention_cut(sample["segment_ids"][None]))
        losses = gpt(sample["tokens"][None], sample["position_ids"][None],
                     attention_cut(sample["segment_ids"][None]), labels=sample["labels"][None])
    return logits[0], losses[0]


@in_process
@pytest.mark.parametrize("arch,window", [(Arch.llama, 0), (Arch.gpt2, 0), (Arch.llama, 6)])
def test_a_conversation_packed_after_another_gives_its_logits_alone(megatron_tp1, arch, window):
    """``arch``: RoPE (relative by construction) and learned absolute positions (restarted);
    ``window``: a sliding window shorter than the conversations (Mistral, Phi-3, Gemma 3),
    which Megatron-Core's local attention used instead of the row's mask (it attended across
    the boundary) until launcher/engines/layer_spec.py combined the two."""
    rng = np.random.default_rng(0)
    model = small(arch=arch, seq_length=48, vocab_size=512, window_size=window)
    gpt = build(model)
    gpt.eval()
    a, b = rng.integers(0, 512, 17), rng.integers(0, 512, 23)
    mask_a, mask_b = np.r_[0, np.ones(16)].astype(np.uint8), np.r_[0, np.ones(22)].astype(
        np.uint8)
    packed = packed_sample(np.r_[a, b], np.r_[mask_a, mask_b],
                           np.r_[np.zeros(17, int), np.ones(23, int)], 48, pad_id=0)
    alone = packed_sample(b, mask_b, np.zeros(23, int), 48, pad_id=0)
    logits_packed, losses_packed = forward(gpt, packed)
    logits_alone, losses_alone = forward(gpt, alone)
    np.testing.assert_allclose(logits_packed[17:17 + 23].numpy(), logits_alone[:23].numpy(),
                               rtol=1e-5, atol=1e-5)
    # the summed per-sample losses: packed (masked) against each conversation alone
    a_alone = packed_sample(a, mask_a, np.zeros(17, int), 48, pad_id=0)
    _, losses_a = forward(gpt, a_alone)
    summed_packed = float((losses_packed * packed["loss_mask"]).sum())
    summed_alone = float((losses_a * a_alone["loss_mask"]).sum()
                         + (losses_alone * alone["loss_mask"]).sum())
    assert summed_packed == pytest.approx(summed_alone, rel=1e-6)


def test_a_resumed_epoch_sees_every_row_once():
    rows = [(0, i, i + 1) for i in range(10)]
    dataset = PackedChatDataset(None, rows, samples=25, seq_length=8, pad_id=0, seed=3)
    order = [dataset.row_of(i) for i in range(25)]
    assert sorted(order[:10]) == rows and sorted(order[10:20]) == rows  # each once per epoch
    assert order[:10] != order[10:20]  # a fresh permutation per epoch
    resumed = PackedChatDataset(None, rows, samples=25, seq_length=8, pad_id=0, seed=3)
    assert [resumed.row_of(i) for i in range(7, 25)] == order[7:]  # a resume at sample 7


@pytest.mark.slow
@pytest.mark.xdist_group("chat_splits")
def test_the_loss_and_gradients_are_the_same_however_the_batch_is_split(tmp_path):
    """Micro-batch 1 x 8 accumulations, 8 x 1, DP2, and the same rows at TP2 with sequence
    parallelism and at PP2 (the mask reaches every stage)."""
    data = write_chat_shards(tmp_path / "data", split_rows())
    common = [*TINY, "model.seq_length=64", "engine=megatron", "trainer.train_steps=1",
              "trainer.global_batch_size=8", "optimizer.warmup_steps=0", "trainer.eval_interval=0",
              "model.hidden_dropout=0", "model.attention_dropout=0",
              f"hydra.searchpath=[file://{data / 'conf'}]", "data=chat"]
    splits = {"mb1x8": ["cluster.gpus_per_node=1", "trainer.micro_batch_size=1"],
              "mb8x1": ["cluster.gpus_per_node=1", "trainer.micro_batch_size=8"],
              "dp2": ["trainer.micro_batch_size=2"],
              "tp2_sp": ["trainer.micro_batch_size=2", "parallelism.tensor_parallel_size=2",
                         "parallelism.sequence_parallel=true"],
              "pp2": ["trainer.micro_batch_size=2", "parallelism.pipeline_parallel_size=2"]}
    lines = {}
    for name, split in splits.items():
        train(tmp_path, name, *common, *split)
        [lines[name]] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl")
                         .read_text().splitlines() if '"loss"' in line]
    base = lines["mb1x8"]  # (per-micro-batch means would give 5.47, 6.26 and 6.26 here)
    masks = [np.concatenate([m for _, m in row]) for row in split_rows()]
    # the targets: each row's mask less its first token (never a label), in the global batch
    assert base["target_tokens"] == sum(int(m[1:].sum()) for m in masks)
    for name, got in lines.items():
        assert got["loss"] == pytest.approx(base["loss"], rel=1e-6), name
        assert got["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6), name
        assert got["target_tokens"] == base["target_tokens"], name


@pytest.mark.parametrize("overrides, fragment", [
    (["engine=deepspeed"], "data.format=chat on engine=deepspeed"),
    (["engine=megatron", "data.prefixes=[]"], "mock data has no conversations"),
])
def test_what_cannot_train_chat_rows_is_refused_before_any_rank_starts(overrides, fragment,
                                                                       tmp_path):
    data = write_chat_shards(tmp_path / "data", split_rows())
    proc = subprocess.run([sys.executable, "-m", "launcher.train", *TINY, "data=chat",
                           f"hydra.searchpath=[file://{data / 'conf'}]",
                           f"run.output_root={tmp_path}", "run.name=r", *overrides],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert fragment in proc.stderr


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_published_weights_in_fine_tuned_on_chats_out_to_transformers_and_back_in_a_chat(
        tmp_path):
    """A tiny Llama in (trainer.init_from), fine-tuned on chatml conversations, exported
    (launcher.convert to_hf): transformers loads it with the chat template and gives our logits;
    launcher.generate generate.chat=true renders the prompt as transformers does."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.helpers.chat import chatml_tokenizer, conversations

    tok_dir = chatml_tokenizer(tmp_path / "tok", 280)
    assert Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size() <= 300
    torch.manual_seed(0)
    hf = tmp_path / "hf_in"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=0.2, tie_word_embeddings=False)).save_pretrained(str(hf))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in
                                                       conversations(120)) + "\n")
    cli("data_prep", f"input={tmp_path / 'in'}", f"output={tmp_path / 'chat'}", "format=chat",
        "tokenizer.kind=hf", f"tokenizer.path={tok_dir}", "chat.template=chatml",
        "seq_length=64", "progress=false", "split='90,10,0'")
    cli("launcher.train", f"trainer.init_from={hf}", "engine=megatron", "trainer.precision=fp32",
        "model.seq_length=64", "trainer.train_steps=3", "optimizer.warmup_steps=0",
        "data.num_workers=0", f"hydra.searchpath=[file://{tmp_path / 'chat' / 'conf'}]",
        "data=chat", f"run.output_root={tmp_path}", "run.name=ft", "run.report=false")
    out = tmp_path / "hf_out"
    cli("launcher.convert", "to_hf", f"checkpoint={tmp_path / 'ft'}", f"out={out}")

    theirs_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    turn = [{"role": "user", "content": "the cat sat on a mat"}]
    prompt = theirs_tok.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nthe cat sat on a mat<|im_end|>\n<|im_start|>assistant\n"
    expected = theirs_tok(prompt, add_special_tokens=False)["input_ids"]
    logits_file = tmp_path / "ours.npy"
    gen = cli("launcher.generate", f"checkpoint={tmp_path / 'ft'}", "generate.chat=true",
              f"generate.prompt={turn[0]['content']}", "generate.max_new_tokens=4",
              "generate.format=json", f"generate.logits_file={logits_file}",
              "trainer.precision=fp32", "cluster.gpus_per_node=1")
    result = json.loads(gen.stdout.strip().splitlines()[-1])
    assert result["prompt_ids"] == expected  # one user turn and the assistant's header
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        theirs = model.eval()(torch.tensor([expected])).logits[0].numpy()
    assert np.abs(np.load(logits_file) - theirs).max() < 1e-4
    assert theirs_tok.eos_token == "<|im_end|>"  # generation stops at the end of the turn


@in_process
def test_generation_stops_after_an_end_of_turn_token(megatron_tp1):
    from launcher.config import GenerateConfig
    from launcher.engines.megatron.generation import Generator

    model = small(seq_length=48, vocab_size=512)
    gpt = build(model)
    gpt.eval()
    generator, prompt = Generator([gpt], vocab_size=512), [5, 17, 42, 99]
    free, _ = generator.generate(prompt, GenerateConfig(max_new_tokens=6))
    assert len(free) == 6
    cut = free.index(free[2])  # the first place that token comes
    stopped, _ = generator.generate(prompt, GenerateConfig(max_new_tokens=6),
                                    stop_ids=frozenset({free[2]}))
    assert stopped == free[:cut + 1]  # up to and including the end-of-turn token
