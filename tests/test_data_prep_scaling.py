"""data_prep with worker processes that read their own input and hand back token files: the same
bytes for 1, 2 or 3 workers when lines straddle block, frame and part boundaries; resume after
kill -9 (also in the middle of a large compressed file); a worker killed by a signal; memory that
does not grow with the corpus. Plus the pieces: CRC-32 combination, zstd frame walking, parts."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
import zlib

import numpy as np
import psutil
import pytest
import zstandard
from tests.helpers.data_prep import PYTHON, REPO, kill_group, load, prepare, read_documents, shard_bytes, start_in_own_group, stdlib_documents, worker_processes

from data_prep.crc import crc32_combine
from data_prep.manifest import shard_problem
from data_prep.zstd_frames import frame_spans

pytestmark = pytest.mark.xdist_group("data_prep_scaling")

BYTE_ARGS = ["tokenizer.kind=byte", "block_bytes=4096", "shard_tokens=20000", "name=s"]


def _lines(count: int, seed: int) -> list:
    """JSONL lines of stdlib text: short, long (several blocks), CRLF-terminated ones."""
    rng, docs = random.Random(seed), stdlib_documents(count, offset=400, max_chars=30_000)
    lines = []
    for i, doc in enumerate(docs):
        text = doc[: rng.choice([40, 900, 5000, 30_000])]
        lines.append(json.dumps({"text": text, "i": i}).encode() + (b"\r\n" if i % 5 == 0 else b"\n"))
    return lines


def _frames(data: bytes, size: int) -> bytes:
    """zstd frames of ``size`` input bytes each, cut anywhere (mid-line), with checksums."""
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    return b"".join(compress(data[i:i + size]) for i in range(0, len(data), size))


@pytest.fixture(scope="module")
def straddling(tmp_path_factory):
    """Inputs whose lines cross block, frame and part boundaries; returns (input spec, texts)."""
    root = tmp_path_factory.mktemp("straddling")
    a, b = _lines(60, 1), _lines(60, 2)
    (root / "a.jsonl").write_bytes(b"".join(a)[:-1])  # the last line has no newline
    (root / "b.jsonl.zst").write_bytes(_frames(b"".join(b)[:-1], 3001))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(a[:20])))
    texts = [json.loads(line)["text"] for line in a + b + a[:20]]
    return f"input=[{root / 'a.jsonl'},{root / 'b.jsonl.zst'},{root / 'c.jsonl.zst'}]", texts


def _texts(out) -> list:
    """Documents of a byte-tokenizer output, decoded (EOD 256 dropped)."""
    return [bytes(doc[:-1].astype(np.uint8)).decode("utf-8") for doc in read_documents(out)]


@pytest.mark.slow
def test_one_two_and_three_workers_write_the_same_bytes(straddling, tmp_path):
    spec, texts = straddling
    outputs = {}
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        prepare(spec, f"output={out}", f"workers={workers}", *BYTE_ARGS)
        outputs[workers] = (shard_bytes(out), load(out / "manifest.json"))
        assert not list(out.glob("*.tmp")), "no temporary shard is left"
    assert _texts(tmp_path / "w1") == texts  # no line lost, doubled or cut at a boundary
    one, manifest = outputs[1]
    assert len(one) >= 10 and manifest["totals"]["repaired"]["crlf_line_ending"] == 28
    for workers in (2, 3):
        assert outputs[workers][0] == one, f"workers={workers} wrote other bytes"
        assert outputs[workers][1]["shards"] == manifest["shards"]
        assert outputs[workers][1]["totals"] == manifest["totals"]


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """About 12 MB: a plain file, a multi-frame .zst and a single-frame .zst (one block of many
    parts), with a workers=1 reference output."""
    root = tmp_path_factory.mktemp("long")
    data = b"".join(_lines(400, 3)) * 4
    (root / "a.jsonl").write_bytes(data)
    (root / "b.jsonl.zst").write_bytes(_frames(data, 200_000))
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    spec = f"input=[{root / 'a.jsonl'},{root / 'b.jsonl.zst'},{root / 'c.jsonl.zst'}]"
    args = ["tokenizer.kind=byte", "block_bytes=262144", "shard_tokens=300000", "name=l"]
    prepare(spec, f"output={root / 'reference'}", "workers=1", *args)
    return spec, args, root / "reference"


def _start(spec: str, out, workers: int, args: list) -> subprocess.Popen:
    cmd = [PYTHON, "-m", "data_prep", spec, f"output={out}", f"workers={workers}", "progress=false", *args]
    return start_in_own_group(cmd)


def _wait_for(out, proc, wanted, timeout: float = 60.0) -> bool:
    """Poll the manifest until ``wanted(shards)``; False when the run ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if wanted(load(out / "manifest.json")["shards"]):
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    return False


def _at_least(count: int):
    return lambda shards: len(shards) >= count





def _final_shard_files(out) -> set:
    return {p.name for p in out.iterdir() if p.suffix in (".bin", ".idx")}


@pytest.mark.slow
def test_kill_9_at_three_workers_then_rerun_equals_uninterrupted(long_run, tmp_path):
    spec, args, reference = long_run
    out = tmp_path / "out"
    proc = _start(spec, out, 3, args)
    assert _wait_for(out, proc, _at_least(2)), "the run ended before it could be killed"
    kill_group(proc)
    manifest = load(out / "manifest.json")
    assert not manifest["complete"]
    listed = {f"{s['prefix']}.{x}" for s in manifest["shards"] for x in ("bin", "idx")}
    extra = _final_shard_files(out) - listed  # killed between a shard's rename and the manifest's
    assert listed <= _final_shard_files(out) and extra <= {f"l_{len(manifest['shards']):05d}.{x}" for x in ("bin", "idx")}
    prepare(spec, f"output={out}", "workers=3", *args)
    assert shard_bytes(out) == shard_bytes(reference)
    assert load(out / "manifest.json")["shards"] == load(reference / "manifest.json")["shards"]
    assert not list(out.glob(".data_prep-spool-*"))


@pytest.mark.slow
def test_a_rerun_resumes_in_the_middle_of_a_single_frame_file(long_run, tmp_path):
    """The state a crash leaves after committing a shard that ends inside the last block (the
    single-frame file, one block of many parts): the re-run skips the committed parts."""
    spec, args, reference = long_run
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    manifest = load(out / "manifest.json")
    last_block = manifest["shards"][-1]["next_block"] - 1
    keep = next(i for i, s in enumerate(manifest["shards"])
                if s["next_block"] == last_block and s["next_part"] > 1) + 1
    for entry in manifest["shards"][keep:]:
        for ext in ("bin", "idx"):
            (out / f"{entry['prefix']}.{ext}").unlink()
    manifest["shards"], manifest["complete"] = manifest["shards"][:keep], False
    (out / "manifest.json").write_text(json.dumps(manifest))
    kept_mtime = (out / f"{manifest['shards'][-1]['prefix']}.bin").stat().st_mtime_ns
    prepare(spec, f"output={out}", "workers=3", *args)
    assert (out / f"{manifest['shards'][-1]['prefix']}.bin").stat().st_mtime_ns == kept_mtime
    assert shard_bytes(out) == shard_bytes(reference)
    assert load(out / "manifest.json")["shards"] == load(reference / "manifest.json")["shards"]


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_fails_the_run_cleanly(long_run, tmp_path):
    spec, args, reference = long_run
    out = tmp_path / "out"
    proc = _start(spec, out, 2, args)
    assert _wait_for(out, proc, _at_least(3)), "the run ended before a worker could be killed"
    workers = worker_processes(proc.pid)
    assert len(workers) == 2
    workers[0].send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert f"a worker process died (pid {workers[0].pid}, killed by signal SIGKILL" in stderr
    assert "re-run the same command to resume" in stderr
    manifest = load(out / "manifest.json")
    assert not manifest["complete"] and not (out / "data.yaml").exists()
    listed = {f"{s['prefix']}.{x}" for s in manifest["shards"] for x in ("bin", "idx")}
    assert _final_shard_files(out) == listed, "a shard file not in the manifest was left behind"
    assert not any(shard_problem(str(out), s) for s in manifest["shards"])
    want = shard_bytes(reference)
    assert all(content == want[name] for name, content in shard_bytes(out).items())


def _peak_rss(tmp_path, name: str, copies: int, lines: list) -> tuple:
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(b"".join(lines) * copies)
    out = tmp_path / f"out_{name}"
    proc = prepare(f"input={path}", f"output={out}", "workers=2", "tokenizer.kind=byte",
                   "block_bytes=262144", "shard_tokens=4000000")
    assert "peak RSS MB, all processes" in proc.stdout
    return load(out / "manifest.json")["memory"], path.stat().st_size


@pytest.mark.slow
def test_peak_memory_is_reported_bounded_and_independent_of_corpus_size(tmp_path):
    """Window: 2 * workers + 1 = 5 blocks of 256 KiB. Corpora of 4x and 16x that window."""
    lines = _lines(200, 4)
    unit = len(b"".join(lines))
    small, small_size = _peak_rss(tmp_path, "small", max(1, 5 * 262144 * 4 // unit), lines)
    large, large_size = _peak_rss(tmp_path, "large", max(4, 5 * 262144 * 16 // unit), lines)
    assert large_size >= 3.5 * small_size
    for memory in (small, large):
        assert len(memory["worker_peak_rss_bytes"]) == 2 and len(memory["hasher_peak_rss_bytes"]) == 1
        assert memory["peak_rss_bytes"] == memory["main_process_peak_rss_bytes"] + sum(
            memory["worker_peak_rss_bytes"]) + sum(memory["hasher_peak_rss_bytes"])
        assert memory["hasher_peak_rss_bytes"][0] > 0
        assert memory["peak_rss_bytes"] < memory["rss_bound_bytes"] == 2 * 1024**3 + 2 * 512 * 1024**2
    # uint16 ids are 2 bytes per input byte here: memory held per byte of corpus would show up
    # as tens of MB between the two runs.
    grown = large["peak_rss_bytes"] - small["peak_rss_bytes"]
    assert grown < (large_size - small_size) / 4, (small, large)


def test_crc32_of_a_concatenation_from_its_parts():
    from data_prep.crc import crc32_combine_python

    rng = random.Random(5)
    for length_a, length_b in [(0, 0), (0, 7), (7, 0), (1, 1), (1000, 65_537), (3, 1 << 20)]:
        a, b = rng.randbytes(length_a), rng.randbytes(length_b)
        for combine in (crc32_combine, crc32_combine_python):
            assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    for length in (1 << 23, (1 << 31) + 5, (1 << 33) + 7):  # shards of many GB
        assert crc32_combine(0x12345678, 0x9ABCDEF0, length) == crc32_combine_python(0x12345678, 0x9ABCDEF0, length)


def test_the_fast_crc32_is_zlib_ngs_and_gives_zlibs_values():
    """Every id is checksummed once; the system zlib's CRC-32 was 4-5% of a run's CPU time."""
    import zlib_ng.zlib_ng

    from data_prep.crc import crc32

    assert crc32 is zlib_ng.zlib_ng.crc32
    rng = random.Random(6)
    for size in (0, 1, 15, 4097, (1 << 22) + 3):
        data = rng.randbytes(size)
        assert crc32(data) == zlib.crc32(data)
        assert crc32(memoryview(data)[size // 3:], crc32(data[: size // 3])) == zlib.crc32(data)


def test_data_prep_keeps_numpy_from_starting_blas_threads():
    """OpenBLAS starts a spinning thread per core when numpy is imported; data_prep does no linear
    algebra, so its main process starts with no thread but its own."""
    code = "import data_prep.__main__, numpy, os; print(len(os.listdir('/proc/self/task')))"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, check=True)
    assert out.stdout.split() == ["1"], out.stdout


def test_zstd_frames_are_found_from_their_headers(tmp_path):
    data = b"".join(b"line %d\n" % i for i in range(50_000))
    first = zstandard.ZstdCompressor(write_checksum=True).compress(data[:100_000])
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    second = zstandard.ZstdCompressor(write_content_size=False).compress(data[100_000:])
    path = tmp_path / "x.zst"
    path.write_bytes(first + skippable + second)
    spans = frame_spans(str(path))
    ends = [len(first), len(first) + 11, len(first) + 11 + len(second)]
    assert [(s.end, s.content_size) for s in spans] == list(zip(ends, [100_000, 0, -1]))
    path.write_bytes(first + second[:-5])  # cut: the rest becomes one span for the decoder to judge
    assert [(s.start, s.end) for s in frame_spans(str(path))] == [(0, len(first)), (len(first), len(first) + len(second) - 5)]


def test_parts_of_all_blocks_give_back_the_stream_exactly(tmp_path):
    from data_prep.blocks import iter_blocks
    from data_prep.inputs import expand_inputs
    from data_prep.parts import iter_parts

    data = b"".join(_lines(80, 6))[:-1]
    for frame in (997, 20_000, len(data)):
        path = tmp_path / f"f{frame}.jsonl.zst"
        path.write_bytes(_frames(data, frame))
        for block_bytes in (1024, 50_000):
            blocks = list(iter_blocks(expand_inputs([str(path)], "auto"), "text", "file", block_bytes))
            parts = [(part, last) for block in blocks for part, last in iter_parts(block, block_bytes)]
            assert b"".join(p.data for p, _ in parts) == data, (frame, block_bytes)
            assert sum(p.input_bytes for p, _ in parts) == path.stat().st_size
            assert sum(last for _, last in parts) == len(blocks)
            assert len(blocks) > 1 or frame == len(data)


def test_a_worker_dead_before_it_starts_is_a_worker_error():
    """Killed between spawn and init (a node under memory pressure): the run fails with the same
    clear WorkerError as a death mid-run, not a BrokenPipeError traceback."""
    from data_prep.errors import WorkerError
    from data_prep.worker_pool import WorkerPool

    pool = WorkerPool(2)
    try:
        victim = pool.processes[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        with pytest.raises(WorkerError, match=rf"worker process died \(pid {victim.pid}, killed "
                                              r"by signal SIGKILL"):
            pool.init(None, {})
    finally:
        pool.close(wait_for_exit=False)


def test_a_forked_worker_dies_of_sigterm_like_a_spawned_one():
    """Workers are forked from the main process, whose SIGTERM handler raises KeyboardInterrupt;
    a worker must not inherit it (Slurm's scancel signals every process of the job: a worker that
    caught it would report an error instead of dying as spawned workers do)."""
    from data_prep.worker_pool import WorkerPool, start_method
    from data_prep.worker_process import WORKER_NAME

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        pool = WorkerPool(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        worker = pool.processes[0]
        deadline = time.time() + 30  # the worker names itself once its signals are set
        while psutil.Process(worker.pid).name() != WORKER_NAME and time.time() < deadline:
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGTERM)
        worker.join(timeout=30)
        assert worker.exitcode == -signal.SIGTERM, (start_method(), worker.exitcode)
    finally:
        pool.close(wait_for_exit=False)


def test_the_main_process_peak_is_its_own_not_its_launchers(tmp_path):
    """Linux carries ``ru_maxrss`` over exec: a data_prep started by a process of 600 MB (a test
    runner, a notebook) reported 600 MB as its own peak, and the test of memory above passed or
    failed with whatever the test runner held."""
    ballast = b"\x01" * (600 * 1024**2)  # resident in this process when it starts data_prep
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_lines(20, 9)))
    out = tmp_path / "out"
    prepare(f"input={path}", f"output={out}", "workers=1", *BYTE_ARGS)
    memory = load(out / "manifest.json")["memory"]
    assert len(ballast) and memory["main_process_peak_rss_bytes"] < 400 * 1024**2, memory


def test_the_input_hasher_process_gives_each_file_its_sha256_or_a_clear_error(tmp_path):
    import hashlib

    from data_prep.errors import WorkerError
    from data_prep.input_hasher import InputHasher

    paths = []
    for size in (0, 5, (1 << 22) + 17):  # empty, small, over one read chunk
        path = tmp_path / f"f{size}"
        path.write_bytes(random.Random(size).randbytes(size))
        paths.append(str(path))
    hasher = InputHasher(paths).start()
    assert hasher.result() == {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}
    hasher.stop()
    InputHasher(paths).stop()  # never started: nothing to end
    with pytest.raises(WorkerError, match="hashing the inputs failed: FileNotFoundError"):
        InputHasher([str(tmp_path / "gone")]).start().result()
    killed = InputHasher(paths * 200)
    killed.start()
    os.kill(killed._processes[0].pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="process hashing the inputs died"):
        killed.result()


def test_hashing_processes_share_the_files_by_bytes_and_give_every_digest(tmp_path):
    """One sha256 runs on one core; a run of many workers hashes with one process per four
    workers, each taking whole files, so the digests do not become what the run waits for."""
    import hashlib

    from data_prep.input_hasher import InputHasher, hasher_count, share_files

    assert [hasher_count(w, 100) for w in (1, 2, 4, 5, 16, 64)] == [1, 1, 1, 2, 4, 16]
    assert hasher_count(64, 3) == 3 and hasher_count(0, 0) == 1
    sizes = {"a": 90, "b": 50, "c": 40, "d": 30, "e": 20, "f": 10}
    shares = share_files(sizes, 3)
    assert sorted(p for share in shares for p in share) == sorted(sizes)
    assert sorted(sum(sizes[p] for p in share) for share in shares) == [70, 80, 90]
    assert share_files({"a": 5}, 4) == [["a"]]
    paths = {}
    for i, size in enumerate((3, 1 << 20, 7, (1 << 22) + 1, 0)):
        path = tmp_path / f"in{i}"
        path.write_bytes(random.Random(i).randbytes(size))
        paths[str(path)] = size
    hasher = InputHasher(list(paths), processes=3, sizes=paths).start()
    assert hasher.processes == 3
    assert hasher.result() == {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}
    hasher.stop()


def _three_files(tmp_path, docs: int = 12) -> list:
    paths = []
    for i in range(3):
        path = tmp_path / f"part{i}.jsonl"
        path.write_bytes(b"".join(_lines(docs, 20 + i)))
        paths.append(path)
    return paths


@pytest.mark.slow
def test_a_run_of_eight_workers_hashes_in_two_processes_and_hash_inputs_false_skips_it(tmp_path):
    import hashlib

    paths = _three_files(tmp_path)
    spec = "input=[" + ",".join(map(str, paths)) + "]"
    prepare(spec, f"output={tmp_path / 'on'}", "workers=8", *BYTE_ARGS)
    manifest = load(tmp_path / "on" / "manifest.json")
    assert manifest["timing"]["hash_processes"] == 2
    assert manifest["timing"]["hash_cpu_s"] > 0
    assert [i["sha256"] for i in manifest["inputs"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    prepare(spec, f"output={tmp_path / 'off'}", "workers=8", "hash_inputs=false", *BYTE_ARGS)
    off = load(tmp_path / "off" / "manifest.json")
    assert [i["sha256"] for i in off["inputs"]] == ["", "", ""]
    assert off["timing"]["hash_processes"] == 0 and "hash_wait_s" not in off["timing"]
    assert shard_bytes(tmp_path / "off") == shard_bytes(tmp_path / "on")


@pytest.mark.slow
def test_the_summary_says_where_the_time_went_and_the_main_process_moves_no_bulk_data(tmp_path):
    """With workers, the main process only orders, places and accounts: its CPU time while
    tokenizing is a small fraction of the workers'. With one process it does all the work."""
    spec = "input=[" + ",".join(map(str, _three_files(tmp_path, docs=60))) + "]"
    shown = prepare(spec, f"output={tmp_path / 'w2'}", "workers=2", "tokenizer.kind=tiktoken",
                    "tokenizer.path=cl100k_base", "block_bytes=65536").stdout
    assert "seconds: plan, tokenize, wait for hashes" in shown and "CPU s: workers, hashing" in shown
    timing = load(tmp_path / "w2" / "manifest.json")["timing"]
    assert timing["tokenize_s"] > 0 and timing["plan_s"] > 0 and timing["startup_cpu_s"] > 0
    assert timing["worker_cpu_s"] > 0.05, timing
    assert timing["main_tokenize_cpu_s"] < timing["worker_cpu_s"] / 4, timing
    prepare(spec, f"output={tmp_path / 'w1'}", "workers=1", "tokenizer.kind=tiktoken",
            "tokenizer.path=cl100k_base", "block_bytes=65536")
    alone = load(tmp_path / "w1" / "manifest.json")["timing"]
    assert alone["worker_cpu_s"] == 0 and alone["main_tokenize_cpu_s"] > 0.05, alone


def test_held_parts_are_written_where_placed_and_bound_the_memory(tmp_path):
    """A worker writes its ids at the offsets the main process gives; over its limit it serves
    place orders before it goes on, keeping other messages (a next block) for later, in order."""
    import multiprocessing

    from data_prep.held_parts import HeldParts

    mine, theirs = multiprocessing.Pipe()
    held = HeldParts(limit=10)
    first, second = np.arange(4, dtype=np.int32), np.arange(100, 106, dtype=np.int32)
    held.keep(0, 0, first)
    held.keep(0, 1, second)
    assert held.bytes == 40 > held.limit
    shard = tmp_path / "s.bin.tmp"
    shard.write_bytes(b"")
    theirs.send(("next block", 1))
    theirs.send(("place", 0, 1, str(shard), 16))  # the second part lands after the first
    theirs.send(("place", 0, 0, str(shard), 0))
    held.serve_pending(mine)  # returns only once it holds no more than its limit
    assert held.bytes == 0 and not held.parts
    assert [theirs.recv(), theirs.recv()] == [("placed", str(shard))] * 2
    held.close()
    assert np.array_equal(np.frombuffer(shard.read_bytes(), np.int32), np.concatenate([first, second]))
    theirs.send(None)
    assert held.next_message(mine) == ("next block", 1)
    assert held.next_message(mine) is None


@pytest.mark.slow
def test_workers_that_must_wait_for_place_orders_still_write_the_same_bytes(straddling, tmp_path, monkeypatch):
    """With a limit of one byte every worker waits for its parts to be placed after each part
    (the case of a slow block ahead of its own): no deadlock, and the same bytes."""
    from data_prep import held_parts
    from data_prep.cli import main

    spec, _ = straddling
    monkeypatch.setattr(held_parts, "HELD_LIMIT_BYTES", 1)  # forked workers inherit it
    previous = signal.getsignal(signal.SIGTERM)
    try:
        for workers in (1, 3):
            assert main([spec, f"output={tmp_path / f'w{workers}'}", f"workers={workers}", "progress=false",
                         *BYTE_ARGS]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert shard_bytes(tmp_path / "w3") == shard_bytes(tmp_path / "w1")


@pytest.mark.slow
def test_the_main_process_waits_on_handles_registered_once_for_any_worker_count(straddling, tmp_path, monkeypatch):
    """multiprocessing's wait() registers every pipe and exit sentinel anew on each call (~300 us
    at 192 workers, several calls per part): at 64+ cores that made the main process the limit
    again. The pool registers them once; every wait goes through that one selector."""
    import selectors

    from data_prep import worker_pool
    from data_prep.cli import main

    counts = {"register": 0, "select": 0}

    class Counting(selectors.DefaultSelector):
        def register(self, *args, **kwargs):
            counts["register"] += 1
            return super().register(*args, **kwargs)

        def select(self, *args, **kwargs):
            counts["select"] += 1
            return super().select(*args, **kwargs)

    monkeypatch.setattr(worker_pool.selectors, "DefaultSelector", Counting)
    spec, _ = straddling
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main([spec, f"output={tmp_path / 'w24'}", "workers=24", "progress=false", *BYTE_ARGS]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    blocks = load(tmp_path / "w24" / "manifest.json")["shards"][-1]["next_block"]
    assert blocks > 24
    assert counts["register"] == 2 * 24, counts  # each pipe and sentinel, once
    assert counts["select"] > 0, counts  # the waits went through it
    prepare(spec, f"output={tmp_path / 'w1'}", "workers=1", *BYTE_ARGS)
    assert shard_bytes(tmp_path / "w24") == shard_bytes(tmp_path / "w1")


def test_a_one_process_run_encodes_on_the_tokenizer_pool_only_beyond_two_cores(monkeypatch):
    from data_prep import pipeline

    for cores, pooled in ((1, False), (2, False), (3, True), (64, True)):
        monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert pipeline.encoder_threads() is pooled, cores
