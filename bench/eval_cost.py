"""Evaluation at its real cost: ``launcher.evaluate`` against lm-evaluation-harness's Hugging Face
backend on the same weights, in one run on one machine (issue 47).

    .venv/bin/python bench/eval_cost.py [--questions 48 240] [--paragraphs 48] [--json out.json]

The weights: a Llama-style Hugging Face model built here with random weights (4 layers, hidden
256, 4 heads, ``max_position_embeddings`` 2,048, fp32) and a byte-level BPE trained here
(data_prep.train_tokenizer, 2,000 ids). The tasks, in lm-evaluation-harness's format:

- ``bench_mc_<N>``: N short multiple-choice questions (four one- or two-word choices; rows of
  about 10-25 tokens), acc and acc_norm;
- ``bench_rolling``: ``--paragraphs`` paragraphs of 60-400 words, rolling log-likelihood (bits per
  byte, word perplexity).

For each task, wall time of the whole command, as a user runs it:

- **ours**: ``python -m launcher.evaluate checkpoint=<hf dir> eval.tasks=[task]`` on the
  default local cluster (2 CPU ranks), fp32, ``model.seq_length`` = 2,048 (the checkpoint's);
  its scoring time beside it (the ``seconds`` of its JSON: rank 0 from the model's build to the
  scores, the rest being start-up and exit);
- **theirs**: ``python -m lm_eval --model hf --model_args pretrained=<dir>,dtype=float32
  --batch_size 8 --device cpu`` (its default batching: requests sorted by length, each batch
  padded to its longest).

The scores are printed beside the times (they must agree: acc exactly, the log-likelihood
metrics to float tolerance). Then the tokens an in-loop evaluation computes for the same rows
(:func:`launcher.evals.rows.score_plan` at 2 replicas, micro-batch 1, seq 2,048) against the
rows' real tokens: packed as here, packed as under Transformer Engine, one row per sequence
sorted by length, and one full sequence per row (rows x 2,048). ``ours`` runs twice side by
side: packed (the default) and unpacked (``eval.pack_length=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("river stone cloud apple window garden silver morning paper candle forest engine "
         "yellow winter bridge letter orange summer pocket mirror valley hammer island "
         "button ladder rocket violet thunder pillow marble jacket basket lemon anchor").split()
SEQ = 2048
HIDDEN = 256


def tokenizer_dir(root: Path) -> Path:
    """A byte-level BPE of 2,000 ids (data_prep.train_tokenizer) as a Hugging Face directory."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as handle:
        for _ in range(3000):
            handle.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(40))
                                     + ". Question: Answer: the of is a"}) + "\n")
    subprocess.run([sys.executable, "-m", "data_prep.train_tokenizer", "--input", str(corpus),
                    "--vocab-size", "2000", "--output", str(root / "tokenizer.json")],
                   cwd=REPO, check=True, capture_output=True)
    out = root / "hf"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"))
    tok.eos_token = tok.convert_ids_to_tokens(0)
    tok.save_pretrained(out)
    return out


def model_dir(hf: Path) -> Path:
    """A random Llama of 4 layers, hidden 256, 2,048 positions, saved beside its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=HIDDEN, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(hf)
    return hf


def write_tasks(folder: Path, questions: list, paragraphs: int) -> list:
    """The task YAML files and their data (absolute paths: lm_eval resolves relative ones
    against its working directory); the task names."""
    rng = random.Random(1)
    names = []
    for n in questions:
        data = folder / f"bench_mc_{n}.jsonl"
        with open(data, "w") as handle:
            for i in range(n):
                choices = rng.sample(WORDS, 4)
                handle.write(json.dumps({"question": f"{rng.choice(WORDS)} {rng.choice(WORDS)} "
                                         f"is like which word", "choices": choices,
                                         "answer": i % 4}) + "\n")
        (folder / f"bench_mc_{n}.yaml").write_text(
            f"task: bench_mc_{n}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\noutput_type: multiple_choice\ntest_split: test\n"
            'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
            "doc_to_target: answer\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
            "    higher_is_better: true\n  - metric: acc_norm\n    aggregation: mean\n"
            "    higher_is_better: true\nmetadata:\n  version: 1.0\n")
        names.append(f"bench_mc_{n}")
    data = folder / "bench_rolling.jsonl"
    with open(data, "w") as handle:
        for _ in range(paragraphs):
            handle.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(
                rng.randint(60, 400))) + "."}) + "\n")
    (folder / "bench_rolling.yaml").write_text(
        f"task: bench_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\noutput_type: loglikelihood_rolling\ntest_split: test\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n    aggregation: weighted_perplexity\n"
        "    higher_is_better: false\n  - metric: bits_per_byte\n    aggregation: bits_per_byte\n"
        "    higher_is_better: false\nmetadata:\n  version: 1.0\n")
    return names + ["bench_rolling"]


def timed(command: list, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3600)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def ours(hf: Path, tasks: Path, task: str, env: dict, *extra: str) -> dict:
    seconds, out = timed([sys.executable, "-m", "launcher.evaluate", f"checkpoint={hf}",
                          f"eval.tasks=[{task}]", f"eval.include_path=[{tasks}]",
                          "eval.format=json", "trainer.precision=fp32", *extra], env)
    record = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": seconds, "scoring_s": record["seconds"], "scores": record["tasks"][task]}


def theirs(hf: Path, tasks: Path, task: str, env: dict, root: Path) -> dict:
    out = root / f"lm_eval_{task}"
    seconds, _ = timed([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={hf},dtype=float32", "--tasks", task, "--include_path",
                        str(tasks), "--batch_size", "8", "--device", "cpu", "--output_path",
                        str(out)], env)
    [result] = list(out.rglob("results_*.json"))
    values = json.loads(result.read_text())["results"][task]
    return {"wall_s": seconds, "scores": {k.split(",")[0]: v for k, v in values.items()
                                          if "stderr" not in k and k != "alias"}}


def token_ratio(hf: Path, tasks: Path, task: str) -> dict:
    """Real and computed tokens of one in-loop evaluation of ``task`` (2 replicas, micro-batch
    1, seq 2,048): packed as on this CPU (an explicit mask: packs of 0.3 x hidden), packed as
    under Transformer Engine (THD: packs of seq), sorted but one row per sequence (the
    previous scheme), and one full sequence per row (the first)."""
    from launcher.config import EvalConfig
    from launcher.evals.count import row_lengths
    from launcher.evals.rows import Packing, computed_tokens, packing_for, score_plan
    from launcher.evals.tokenizer import TextTokenizer

    lengths = row_lengths(EvalConfig(tasks=[task], include_path=[str(tasks)]),
                          TextTokenizer(hf / "tokenizer.json").encode, SEQ)
    real = sum(lengths)

    def computed(packing: Packing) -> int:
        return computed_tokens(score_plan(lengths, dp=2, seq=SEQ, micro_batch=1,
                                          packing=packing), 2)
    return {"rows": len(lengths), "real_tokens": real,
            "computed_vs_real": computed(packing_for(0, seq=SEQ, hidden=HIDDEN, thd=False)) / real,
            "thd_vs_real": computed(packing_for(0, seq=SEQ, hidden=HIDDEN, thd=True)) / real,
            "unpacked_vs_real": computed(Packing()) / real,
            "padded_to_seq_vs_real": len(lengths) * SEQ / real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, nargs="+", default=[48, 240])
    parser.add_argument("--paragraphs", type=int, default=48)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}
    results = []
    with tempfile.TemporaryDirectory(prefix="tw_eval_cost_") as tmp:
        root = Path(tmp)
        hf = model_dir(tokenizer_dir(root))
        (root / "tasks").mkdir()
        for task in write_tasks(root / "tasks", args.questions, args.paragraphs):
            tokens = token_ratio(hf, root / "tasks", task)  # also fills the datasets cache
            row = {"task": task, "ours": ours(hf, root / "tasks", task, env),
                   "ours_unpacked": ours(hf, root / "tasks", task, env, "eval.pack_length=1"),
                   "theirs": theirs(hf, root / "tasks", task, env, root), "tokens": tokens}
            row["ours_vs_theirs"] = row["ours"]["wall_s"] / row["theirs"]["wall_s"]
            results.append(row)
            tokens = row["tokens"]
            print(f"{task:>16}: ours {row['ours']['wall_s']:6.1f} s (scoring "
                  f"{row['ours']['scoring_s']:.1f} s; unpacked {row['ours_unpacked']['wall_s']:.1f}"
                  f" s, scoring {row['ours_unpacked']['scoring_s']:.1f} s), lm_eval "
                  f"{row['theirs']['wall_s']:6.1f} s ({row['ours_vs_theirs']:.2f}x)\n"
                  f"{'':>18}in-loop tokens vs the rows': packed {tokens['computed_vs_real']:.2f}x "
                  f"(THD packs: {tokens['thd_vs_real']:.2f}x), unpacked "
                  f"{tokens['unpacked_vs_real']:.2f}x, a sequence a row "
                  f"{tokens['padded_to_seq_vs_real']:.0f}x\n"
                  f"{'':>18}ours {row['ours']['scores']}\n{'':>18}unpacked "
                  f"{row['ours_unpacked']['scores']}\n{'':>18}lm_eval "
                  f"{row['theirs']['scores']}", flush=True)
    if args.json:
        from launcher.plan.machine import cpu_info

        host = {"cpu": cpu_info().model, "cores": os.cpu_count()}
        Path(args.json).write_text(json.dumps({"host": host, "started": time.strftime(
            "%Y-%m-%d %H:%M"), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
