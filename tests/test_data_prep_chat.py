"""``python -m data_prep format=chat``: conversations (JSONL and Parquet, messages and
prompt/completion) into packed shards with a loss mask that megatron-core's own reader loads;
rows never over seq_length + 1; bad records counted with file:line; the manifest and the data
config; the plan refuses chat shards under a text config, shards without a loss mask under a
chat one and rows packed for another seq_length; an edited template or tokenizer is another run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import Tokenizer

from tests.helpers.chat import WORDS, chatml_tokenizer, conversations, split_rows, write_chat_shards
from tests.helpers.training import REPO, TINY

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return chatml_tokenizer(tmp_path_factory.mktemp("chat_tok"), 600)


def prepare(tmp_path, tokenizer_dir, *extra, inputs=None, expect=0, out="out"):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "data_prep", f"input={inputs or tmp_path / 'in'}",
                           f"output={tmp_path / out}", "format=chat", "tokenizer.kind=hf",
                           f"tokenizer.path={tokenizer_dir}", "chat.template=chatml",
                           "seq_length=255", "progress=false", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def write_inputs(tmp_path, records: list) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir()
    half = len(records) // 2
    with open(tmp_path / "in" / "a.jsonl", "w") as handle:
        for record in records[:half]:
            handle.write(json.dumps(record) + "\n")
    rows = records[half:]  # Parquet: one column per key, nulls where a record lacks it
    pq.write_table(pa.Table.from_pylist([{"messages": r.get("messages"), "prompt": r.get("prompt"),
                                          "completion": r.get("completion")} for r in rows]),
                   tmp_path / "in" / "b.parquet")


@pytest.mark.slow
def test_conversations_become_packed_masked_shards_megatron_reads(tmp_path, tokenizer_dir):
    records = conversations(400)
    write_inputs(tmp_path, records)
    prepare(tmp_path, tokenizer_dir, "workers=2")
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    totals, chat = manifest["totals"], manifest["chat"]
    assert manifest["format"] == "chat" and totals["records"] == 400 and totals["bad_records"] == 0
    assert totals["conversations"] + totals["no_target"] + totals["dropped_long"] == 400
    assert chat["template"] == "chatml" and chat["row_tokens"] == 256 and chat["pack"] is True

    tokens = IndexedDataset(str(out / "out_00000"))
    masks = IndexedDataset(str(out / "out_00000.mask"))
    assert len(tokens) == len(masks) == totals["conversations"]  # a sequence per conversation
    rows = tokens.document_indices
    assert len(rows) - 1 == totals["rows"] and (rows == masks.document_indices).all()
    lengths = tokens.sequence_lengths
    row_tokens = [int(lengths[a:b].sum()) for a, b in zip(rows[:-1], rows[1:])]
    assert max(row_tokens) <= 256 and sum(row_tokens) == totals["tokens"]
    assert chat["packing_efficiency"] == pytest.approx(totals["tokens"] / (256 * totals["rows"]),
                                                       abs=1e-6)
    assert chat["packing_efficiency"] > 0.95

    decoder = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    end = decoder.token_to_id("<|im_end|>")
    replies = {m["content"] for r in records for m in r.get("messages", [])
               if m["role"] == "assistant"} | {r["completion"] for r in records if "completion" in r}
    trained = 0
    for i in range(len(tokens)):
        ids, mask = tokens[i], masks[i]
        assert len(ids) == len(mask) and set(np.unique(mask)) <= {0, 1}
        runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        for run in runs:
            if not mask[run[0]]:
                continue
            trained += len(run)
            text = decoder.decode(ids[run].tolist(), skip_special_tokens=False)
            if len(ids) == 256 and run[-1] == 255 and ids[-1] != end:  # a truncated reply
                assert any(r.startswith(text) for r in replies), text
                continue
            assert ids[run[-1]] == end  # one assistant reply and its end-of-turn token
            assert text[:-len("<|im_end|>")] in replies, text
    assert trained == totals["target_tokens"] and mask[0] == 0

    data = (out / "conf" / "data" / "out.yaml").read_text()
    assert "format: chat" in data and str(out / "out_00000") in data
    # the plan counts conversation tokens and padding apart, from the manifest
    from launcher.compose import compose_config, to_object
    from launcher.plan import compute_plan
    from launcher.plan.data_check import vocab_problems

    cfg = to_object(compose_config([f"hydra.searchpath=[file://{out / 'conf'}]", "data=out",
                                    "engine=megatron", "model.vocab_size=640",
                                    "model.seq_length=255"]))
    shares = compute_plan(cfg).chat_tokens
    assert shares["real"] == pytest.approx(totals["tokens"] / (256 * totals["rows"]))
    assert shares["trained"] == pytest.approx(totals["target_tokens"] / (256 * totals["rows"]))
    assert vocab_problems([str(out / "out_00000")], 100)  # the manifest's vocabulary is checked


def test_bad_records_are_counted_with_file_and_line(tmp_path, tokenizer_dir):
    (tmp_path / "in").mkdir()
    good = conversations(6)
    lines = [json.dumps(r) for r in good] + ["{not json", json.dumps({"messages": [
        {"role": "user", "content": "hi"}]}), json.dumps({"messages": [
        {"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})]
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(lines) + "\n")
    proc = prepare(tmp_path, tokenizer_dir, "workers=1", "max_bad_fraction=0.5")
    totals = json.loads((tmp_path / "out" / "manifest.json").read_text())["totals"]
    assert totals["records"] == 9 and totals["bad_records"] == 3
    assert totals["skipped"] == {"invalid_json": 1, "bad_conversation": 2}
    examples = totals["examples"]["bad_conversation"]
    assert [e[1] for e in examples] == [8, 9] and "assistant" in examples[0][2]
    assert f"{tmp_path / 'in' / 'c.jsonl'}:7" in proc.stderr
    strict = prepare(tmp_path, tokenizer_dir, "workers=1", "strict=true", out="strict", expect=3)
    assert not list((tmp_path / "strict").glob("*.bin"))  # nothing left under a final name
    assert "c.jsonl:7: invalid_json" in strict.stderr


def test_long_conversations_truncated_or_dropped_and_counted(tmp_path, tokenizer_dir):
    (tmp_path / "in").mkdir()
    long = {"messages": [{"role": "user", "content": "tell me"},
                         {"role": "assistant", "content": " ".join(WORDS * 40)}]}
    short = [{"prompt": f"hi {i}", "completion": "hello there"} for i in range(4)]
    (tmp_path / "in" / "l.jsonl").write_text("\n".join(json.dumps(r) for r in
                                                       [long] + short) + "\n")
    prepare(tmp_path, tokenizer_dir, "workers=1")
    totals = json.loads((tmp_path / "out" / "manifest.json").read_text())["totals"]
    assert totals["truncated"] == 1 and totals["conversations"] == 5
    prepare(tmp_path, tokenizer_dir, "workers=1", "chat.overlong=drop", "overwrite=true")
    totals = json.loads((tmp_path / "out" / "manifest.json").read_text())["totals"]
    assert totals["dropped_long"] == 1 and totals["conversations"] == 4


def test_chat_without_seq_length_or_hf_tokenizer_is_a_config_error(tmp_path, tokenizer_dir):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "c.jsonl").write_text(json.dumps(conversations(1)[0]) + "\n")
    proc = prepare(tmp_path, tokenizer_dir, "seq_length=0", "tokenizer.kind=byte", expect=2)
    assert "seq_length=0" in proc.stderr and "tokenizer.kind=byte" in proc.stderr


def test_chat_shards_under_a_text_config_exit_2_before_any_rank_starts(tmp_path):
    """Read as text, chat rows would train on prompts, templates and across conversations."""
    data = write_chat_shards(tmp_path / "data", split_rows())
    proc = subprocess.run([sys.executable, "-m", "launcher.train", *TINY, "data=chat",
                           "data.format=text", f"hydra.searchpath=[file://{data / 'conf'}]",
                           f"run.output_root={tmp_path}", "run.name=r"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{data / 'chat_00000'} holds data_prep format=chat shards" in proc.stderr
    assert "set data.format=chat" in proc.stderr
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").rglob("rank_*"))


def plan_of(data, *overrides):
    from launcher.compose import compose_config, to_object
    from launcher.plan import compute_plan

    return compute_plan(to_object(compose_config(
        [*TINY, "engine=megatron", "data=chat", f"hydra.searchpath=[file://{data / 'conf'}]",
         *overrides])))


def test_the_plan_refuses_rows_packed_for_another_seq_length(tmp_path):
    from launcher.plan import PlanError

    data = write_chat_shards(tmp_path / "data", split_rows())
    for packed in (255, 32):  # longer rows do not fit; shorter ones leave each row half empty
        (data / "manifest.json").write_text(json.dumps(
            {"format": "chat", "chat": {"seq_length": packed, "pack_multiple": 1}}))
        with pytest.raises(PlanError) as refused:
            plan_of(data)
        assert (f"model.seq_length=64, but {data / 'manifest.json'} was packed into rows for "
                f"seq_length={packed}") in str(refused.value)
        assert "re-run data_prep format=chat with seq_length=64" in str(refused.value)
    (data / "manifest.json").write_text(json.dumps(
        {"format": "chat", "chat": {"seq_length": 64, "pack_multiple": 1}}))
    assert plan_of(data).dims.world >= 1


def test_the_plan_refuses_text_shards_under_a_chat_config(tmp_path):
    from launcher.plan import PlanError

    data = write_chat_shards(tmp_path / "data", split_rows())
    for suffix in (".mask.bin", ".mask.idx"):
        (data / f"chat_00000{suffix}").unlink()
    with pytest.raises(PlanError, match=r"has no loss mask .*data_prep format=chat"):
        plan_of(data)


@pytest.mark.parametrize("edited", ["template", "tokenizer"])
def test_an_edited_template_or_tokenizer_is_another_run_not_a_finished_one(tmp_path,
                                                                           tokenizer_dir, edited):
    """The resume fingerprint covers the template's text and the tokenizer files' bytes: a
    re-run after an edit is refused as another run's output (overwrite=true rebuilds)."""
    import shutil

    from launcher.core.chat_render import TEMPLATE_DIR

    write_inputs(tmp_path, conversations(20, seed=3))
    tokenizer = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    template = tmp_path / "mine.jinja"
    template.write_text((TEMPLATE_DIR / "chatml.jinja").read_text())
    settings = ["workers=1", f"chat.template={template}"]
    prepare(tmp_path, tokenizer, *settings)
    first = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert prepare(tmp_path, tokenizer, *settings).returncode == 0  # unchanged: already done
    if edited == "template":  # one more newline after each message
        template.write_text(template.read_text().replace("'<|im_end|>\\n'", "'<|im_end|>\\n\\n'"))
    else:
        config = json.loads((tokenizer / "tokenizer_config.json").read_text())
        (tokenizer / "tokenizer_config.json").write_text(json.dumps(
            {**config, "model_max_length": 4096}))
    refused = prepare(tmp_path, tokenizer, *settings, expect=2)
    assert "holds the output of another run" in refused.stderr
    prepare(tmp_path, tokenizer, *settings, "overwrite=true")
    again = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert again["fingerprint"] != first["fingerprint"]
    if edited == "template":
        assert again["totals"]["tokens"] > first["totals"]["tokens"]


def test_data_prep_help_names_the_chat_format_and_its_settings():
    proc = subprocess.run([sys.executable, "-m", "data_prep", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    for name in ("format=chat", "seq_length=", "chat.template=", "chat.mask=", "chat.pack=",
                 "chat.overlong=", "chat.pack_window=", "chat.pack_multiple="):
        assert name in proc.stdout + proc.stderr, name


@pytest.mark.slow
def test_killed_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, tokenizer_dir):
    import signal
    import time

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in
                                                       conversations(3000, seed=2)) + "\n")
    small = ["workers=1", "shard_bytes=4000", "chat.pack_window=40"]
    prepare(tmp_path, tokenizer_dir, *small, out="ref")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "data_prep", f"input={tmp_path / 'in'}",
                             f"output={run}", "format=chat", "tokenizer.kind=hf",
                             f"tokenizer.path={tokenizer_dir}", "chat.template=chatml",
                             "seq_length=255", "progress=false", *small], cwd=REPO, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(run.glob("*.mask.idx"))) < 3 and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = json.loads((run / "manifest.json").read_text())
    assert killed["complete"] is False and len(killed["shards"]) >= 2  # cut off part-way
    again = prepare(tmp_path, tokenizer_dir, *small, out="run")
    assert "resuming after" in again.stderr
    ref, got = (json.loads((d / "manifest.json").read_text()) for d in (tmp_path / "ref", run))
    assert got["complete"] and got["totals"] == ref["totals"]
    files = sorted(p.name for p in (tmp_path / "ref").glob("ref_*"))
    assert sorted(p.name.replace("run_", "ref_") for p in run.glob("run_*")) == files
    for name in files:
        assert (run / name.replace("ref_", "run_")).read_bytes() == \
            (tmp_path / "ref" / name).read_bytes(), name


def test_a_dry_run_estimates_from_a_sample_and_writes_nothing(tmp_path, tokenizer_dir):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in
                                                       conversations(5000, seed=4)) + "\n")
    proc = prepare(tmp_path, tokenizer_dir, "workers=1", "dry_run=true")
    lines = dict(line.strip().split(None, 1)[::1] for line in proc.stdout.splitlines()[1:]
                 if line.startswith("  ") and "(estimate)" not in line)
    estimate = next(line for line in proc.stdout.splitlines() if "(estimate)" in line)
    assert "2,000 conversations" in lines["sample"]  # the sample, not the whole input
    assert abs(int(estimate.split()[-1].replace(",", "")) - 5000) <= 250  # within 5%
    assert not (tmp_path / "out").exists()  # nothing was written


def conversations_of(out) -> list:
    """(ids, mask) of every conversation of the chat shards in ``out``, as bytes, sorted."""
    found = []
    for idx in sorted(out.glob("*.idx")):
        if idx.name.endswith(".mask.idx"):
            continue
        prefix = str(idx)[:-len(".idx")]
        tokens, masks = IndexedDataset(prefix), IndexedDataset(prefix + ".mask")
        found += [(tokens[i].tobytes(), masks[i].tobytes()) for i in range(len(tokens))]
    return sorted(found)


def merge(out, *extra, expect=0):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "data_prep.merge", str(out), *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_array_tasks_merge_into_the_conversations_of_one_run(tmp_path, tokenizer_dir):
    """Two array tasks (a share of the inputs each) and data_prep.merge: the merged manifest
    and data config hold every conversation of a single run once, with its mask, and the
    totals of that run; a task run with other chat settings is refused by the merge."""
    write_inputs(tmp_path, conversations(300, seed=3))
    prepare(tmp_path, tokenizer_dir, "workers=1", out="single")
    for index in (0, 1):
        prepare(tmp_path, tokenizer_dir, "workers=1", "num_tasks=2", f"task_index={index}",
                "name=arr")
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists() and not (out / "data.yaml").exists()
    tasks = [json.loads((out / f"manifest.task-0000{i}-of-00002.json").read_text())
             for i in (0, 1)]
    assert [len(t["inputs"]) for t in tasks] == [1, 1] and all(t["shards"] for t in tasks)
    assert merge(out, "--split=90,10,0").returncode == 0
    merged = json.loads((out / "manifest.json").read_text())
    single = json.loads((tmp_path / "single" / "manifest.json").read_text())
    assert merged["format"] == "chat" and merged["merged_tasks"] == 2
    for key in ("records", "conversations", "tokens", "target_tokens", "truncated",
                "dropped_long", "no_target", "bad_records"):
        assert merged["totals"][key] == single["totals"][key], key
    assert merged["totals"]["rows"] == sum(t["totals"]["rows"] for t in tasks)
    assert merged["chat"]["packing_efficiency"] == pytest.approx(
        merged["totals"]["tokens"] / (256 * merged["totals"]["rows"]), abs=1e-6)
    assert conversations_of(out) == conversations_of(tmp_path / "single")
    data = (out / "conf" / "data" / "arr.yaml").read_text()
    assert "format: chat" in data and "split: 90,10,0" in data
    assert "arr_task00000_00000" in data and "arr_task00001_00000" in data

    from launcher.runtime.chat_data import ChatRows  # training reads the merged shards
    import yaml

    rows = ChatRows(yaml.safe_load(data)["prefixes"])
    assert sum(map(len, rows.rows)) == merged["totals"]["rows"]
    # a task re-run with another mask policy cannot be merged with the other
    prepare(tmp_path, tokenizer_dir, "workers=1", "num_tasks=2", "task_index=1", "name=arr",
            "chat.mask=last", "overwrite=true")
    refused = merge(out, expect=3)
    assert "task 1 has chat.mask='last' but task 0 has 'assistant'" in refused.stderr


def test_packed_at_a_multiple_every_row_has_room_to_pad_its_conversations(tmp_path,
                                                                          tokenizer_dir):
    """chat.pack_multiple=4 (for CP=2): each row holds its conversations rounded up to 4 within
    seq_length tokens, so the THD layout pads every row the shards hold; seq_length must be a
    multiple."""
    from launcher.engines.packed_rows import to_thd
    from launcher.runtime.chat_data import ChatRows, packed_sample

    write_inputs(tmp_path, conversations(200, seed=5))
    prepare(tmp_path, tokenizer_dir, "workers=1", "seq_length=256", "chat.pack_multiple=4")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["chat"]["pack_multiple"] == 4 and manifest["chat"]["row_tokens"] == 257
    rows = ChatRows([str(tmp_path / "out" / "out_00000")])
    lengths = rows.tokens[0].sequence_lengths
    for _, first, end in rows.rows[0]:
        assert sum(-(-int(n) // 4) * 4 for n in lengths[first:end]) <= 256
        sample = packed_sample(*rows.row((0, first, end)), 256, 0)
        flat, params = to_thd({k: v[None] for k, v in sample.items()}, multiple=4)
        assert (params.cu_seqlens_q_padded % 4 == 0).all()
        assert flat["loss_mask"].sum() == sample["loss_mask"].sum()
    assert manifest["chat"]["packing_efficiency"] > 0.9
    refused = prepare(tmp_path, tokenizer_dir, "seq_length=255", "chat.pack_multiple=4",
                      out="odd", expect=2)
    assert "chat.pack_multiple=4" in refused.stderr and "seq_length=255" in refused.stderr


def _caught_signals(pid: int) -> int:
    """The SigCgt mask of process ``pid`` (bit n-1: a handler of signal n is installed)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigCgt for {pid}")


def test_render_workers_end_on_sigterm_and_exit_without_being_signalled(tmp_path,
                                                                        tokenizer_dir):
    """The workers of a chat run are forked from a process whose SIGTERM handler stops the run
    (data_prep.cli's). They must not keep it: a pool torn down by SIGTERM then waited forever for
    a worker blocked on the task queue's lock (one run in about 30 hung at exit). At the end of
    the records the workers exit on their own (the pool is closed, not terminated)."""
    import multiprocessing
    import signal

    from data_prep import cli
    from data_prep.chat_prep import ChatTask, chat_files
    from data_prep.chat_records import rendered

    write_inputs(tmp_path, conversations(600, seed=6))
    cfg = cli.compose([f"input={tmp_path / 'in'}", f"output={tmp_path / 'out'}", "format=chat",
                       "tokenizer.kind=hf", f"tokenizer.path={tokenizer_dir}",
                       "chat.template=chatml", "seq_length=255", "workers=2"])
    files = chat_files(cfg, ChatTask.of(cfg, str(tmp_path / "out")))
    previous = signal.signal(signal.SIGTERM, cli._interrupt)
    try:
        results = rendered(files, cfg, skip=0)
        first = next(results)
        workers = multiprocessing.active_children()
        assert len(workers) == 2 and first[4] == ""
        for worker in workers:  # not data_prep's handler: SIGTERM ends a worker at once
            assert not _caught_signals(worker.pid) >> (signal.SIGTERM - 1) & 1, worker.pid
        assert 1 + sum(1 for _ in results) == 600
        assert [w.exitcode for w in workers] == [0, 0]  # they ended on the queue's sentinel
    finally:
        signal.signal(signal.SIGTERM, previous)
