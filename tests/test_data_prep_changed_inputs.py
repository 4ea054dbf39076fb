"""An input changed, truncated or removed during a run fails it (exit 3, every changed file named)
instead of finishing with the missing bytes silently left out; the output is not marked complete,
and its re-run says what differs from the run that wrote it."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from tests.helpers.data_prep import PYTHON, REPO, load, prepare, shard_bytes, stdlib_documents, write_jsonl

from data_prep.blocks import Block
from data_prep.errors import InputChangedError
from data_prep.inputs import changed_inputs, check_unchanged, expand_inputs
from data_prep.manifest import fingerprint_differences
from data_prep.parts import iter_parts
from launcher.core.exits import BAD_DATA_EXIT, CONFIG_ERROR_EXIT

ARGS = ["tokenizer.kind=byte", "block_bytes=16384", "shard_tokens=40000", "name=c", "workers=2"]


def test_a_listed_range_past_the_end_of_the_file_is_an_input_change(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["x" * 100] * 10)
    size = path.stat().st_size
    block = Block(0, 0, str(path), "jsonl", start=0, end=size + 50, input_bytes=size + 50)
    with pytest.raises(InputChangedError, match=f"bytes 0-{size + 50:,} were listed, the file "
                                                f"ends at {size:,} now"):
        list(iter_parts(block, 1 << 20))


def test_changed_inputs_names_each_change(tmp_path):
    paths = [write_jsonl(tmp_path / f"{name}.jsonl", ["text"]) for name in "abcd"]
    files = expand_inputs([str(tmp_path / "*.jsonl")], "auto")
    check_unchanged(files)
    paths[0].unlink()
    with open(paths[1], "a", encoding="utf-8") as handle:
        handle.write('{"text": "more"}\n')
    stat = paths[2].stat()
    os.utime(paths[2], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert changed_inputs(files) == [
        f"{paths[0]}: removed",
        f"{paths[1]}: {files[1].size:,} bytes when listed, {paths[1].stat().st_size:,} now",
        f"{paths[2]}: modified after it was listed (same size)"]
    with pytest.raises(InputChangedError, match="3 input file"):
        check_unchanged(files)


def test_fingerprint_differences_name_settings_and_files():
    old = {"inputs": [[f"/d/{i}", 10, 1] for i in range(9)], "block_bytes": 8, "stem": "c"}
    new = {"inputs": [["/d/0", 11, 2], ["/d/1", 10, 5]] + [[f"/d/{i}", 10, 1] for i in range(2, 8)]
           + [["/d/new", 1, 1]], "block_bytes": 16, "stem": "c", "bos_id": -1}
    assert fingerprint_differences(old, new, shown=3) == [
        "input /d/new is new", "input /d/8 is no longer an input", "input /d/0 changed (10 bytes, now 11)",
        "1 more input(s) differ", "block_bytes was 8, now 16", "bos_id was '(absent)', now -1"]
    reordered = {"inputs": old["inputs"][::-1], "block_bytes": 8, "stem": "c"}
    assert fingerprint_differences(old, reordered) == ["the inputs are in another order"]


def _wait_for_shards(out, count, proc, timeout=60.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(load(out / "manifest.json")["shards"]) >= count:
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    return False


@pytest.mark.slow
def test_an_input_truncated_mid_run_fails_it_and_the_rerun_says_why(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", stdlib_documents(200, offset=500, max_chars=12_000))
    listed, out = path.stat().st_size, tmp_path / "out"
    cut = path.read_bytes().rfind(b"\n", 0, listed // 3) + 1  # whole lines are left
    proc = subprocess.Popen([PYTHON, "-m", "data_prep", f"input={path}", f"output={out}",
                             "progress=false", *ARGS], cwd=REPO, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert _wait_for_shards(out, 2, proc), "the run ended before it could be paused"
    os.killpg(proc.pid, signal.SIGSTOP)  # the whole run, workers included, while it is cut short
    os.truncate(path, cut)
    os.killpg(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == BAD_DATA_EXIT, stderr
    assert (f"input file(s) changed during the run: {path}: {listed:,} bytes when listed, "
            f"{cut:,} now") in stderr
    assert not load(out / "manifest.json")["complete"]
    again = prepare(f"input={path}", f"output={out}", *ARGS, check=False)
    assert again.returncode == CONFIG_ERROR_EXIT
    assert f"input {path} changed ({listed:,} bytes, now {cut:,})" in again.stderr
    prepare(f"input={path}", f"output={out}", "overwrite=true", *ARGS)
    prepare(f"input={path}", f"output={tmp_path / 'fresh'}", *ARGS)
    assert shard_bytes(out) == shard_bytes(tmp_path / "fresh")
