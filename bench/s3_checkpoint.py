"""Checkpoints on object storage: the clients' raw rates and our save and load, side by side in
one run against the same S3 server.

    python bench/s3_checkpoint.py [--workdir /tmp/tw_s3ckpt] [--reps 3] [--models gpt2_124m,wide]
                                  [--skip-clients] [--skip-async] [--as-objectstore all|first|none]
                                  [--hook FILE] [--resume-ab PAIRS] [--server-cpus 0]
                                  [--out bench/results/s3_checkpoint.json]

Starts its own SeaweedFS (tests/helpers/s3.py's server, with room for a few GB of volumes) and,
in that one run:

1. **Clients.** The same random bytes (4 x 256 MiB = 1.07 GB, and 16 x 32 MiB = 0.54 GB) put and
   got by boto3 (one s3transfer TransferManager), obstore (``put`` multipart, ``get_ranges``) and
   s3torchconnector (its CRT client's S3Writer / S3Reader), each with 32 MiB parts and
   ``--inflight`` parts in flight in one process; GB/s of the best of ``--reps``.
2. **Ours.** For each model (``gpt2_124m``; ``wide``: gpt2_124m at hidden 1024, ffn 4096, 16
   heads, 3.2 GB of state), engine=megatron, 2 CPU ranks (DP2), fp32, seq 128, global batch 2:
   a. ``launcher.train`` saving to the run directory only: the local (staging) write's seconds,
      and the engine's build (timed by a sitecustomize wrapped around the engine spec's
      ``build``, and ``launcher.core.objectstore.upload``/``download``: timing only, nothing
      else changes);
   b. the same run with ``trainer.checkpoint_uri=s3://...``: the ``checkpoint`` event's bytes and
      seconds (local staging write, with the uploads of the files already closed running
      alongside it, + the rest of every rank's upload + the commit), and the window of
      ``objectstore.upload`` (first rank's start to last rank's end: what was left to send
      after the write);
   c. the raw rate of the same staged files: 2 processes, each putting the share our ranks put
      (``checkpoint_store.assign``) and getting the share a resume downloads, with plain boto3:
      ``as-objectstore`` (upload_file/download_file per file on 4 threads, each with
      ``objectstore.PART_BYTES`` parts and ``objectstore.CONCURRENCY`` in flight: what
      launcher.core.objectstore does, without its retries) and one TransferManager per process
      with 8 and 16 parts in flight; raw = the best;
   d. a new run directory resuming from the store (``trainer.load=s3://.../step_000001``): the
      download's window, the engine's read (its ``checkpoint ... loaded`` event, which includes
      the wait for the download's last file) and **the load**: from the download's first
      request to that event, less (a)'s build seconds (the download runs while the engine is
      built, so this is what the resume adds to a start-up that builds the engine anyway);
   e. (gpt2_124m) ``trainer.async_save=true`` saving every 3 steps: ``time/checkpoint`` of the
      step rows 3, 4 and 5 (the save call, then the polls, one of which starts the upload), next
      to the local staging write of (a). The run is SIGKILLed once row 5 is written: the save
      at step 6 (which waits for step 3's upload) is not what is measured.
   f. (``--resume-ab PAIRS``) resumes alternating the download during the build (as
      launcher.train does) and the download landed first (the hook's ``TW_BENCH_SEQUENTIAL``).
3. Prints the tables and the ratios ours / raw, and writes everything to ``--out``. A training
   run that fails (a save that never commits, the hang watchdog) is that model's result: its
   exit code and last lines; the bench goes on with the next model.

``--hook FILE`` runs FILE's code first in every training process of the bench (a
sitecustomize): a prototype of a change to launcher.core.objectstore, say, measured against the
same raw rates before it is made. docs/storage.md ("Choosing the client", "Measured save and
load") has the figures.

The server shares the machine with the ranks and the bench (on the 2-core CPU machine it is
the bottleneck), so the figures are of this setup; the ratios are what carries over.
``--server-cpus 0`` gives the server core 0 alone and everything else the other cores (a store
whose CPU is not the node's, as on a real deployment; the raw rates are measured the same way).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from launcher.core import objectstore  # noqa: E402
from launcher.core.objectstore import ObjectURI  # noqa: E402
from tests.helpers import s3 as s3h  # noqa: E402

BUCKET = "bench"
PART = 32 * 2**20
STEP = "step_000001"
MODELS = {
    "gpt2_124m": ["model=gpt2_124m"],
    "wide": ["model=gpt2_124m", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
             "model.num_attention_heads=16"],
    "tiny": ["model=tiny"],
}
"""Name -> model overrides (``wide``: 204M parameters, 3.2 GB of fp32 weights + Adam state;
``tiny``: a seconds-long check of the bench itself)."""
COMMON = ["engine=megatron", "model.seq_length=128", "trainer.micro_batch_size=1",
          "trainer.global_batch_size=2", "trainer.precision=fp32", "trainer.eval_interval=0",
          "logger=none", "run.report=false", "resilience.restarts_in_job=0",
          "trainer.checkpoint_retry_s=1200"]
"""Every run: 2 ranks (cluster local_cpu), DP2. A long retry budget, so that a save on the loaded
machine finishes (its seconds then show the retries) rather than fails."""

TIMING_HOOK = '''
import json, os, time
if os.environ.get("TW_BENCH_TIMES"):
    from launcher.core import objectstore as _o

    def _timed(name, orig):
        def run(items, *args, **kwargs):
            items, start = list(items), time.time()
            with open(os.environ["TW_BENCH_TIMES"], "a") as f:
                f.write(json.dumps({"op": name + "-start", "rank": os.environ.get("RANK"),
                                    "start": start, "files": len(items)}) + "\\n")
            try:
                return orig(items, *args, **kwargs)
            finally:
                with open(os.environ["TW_BENCH_TIMES"], "a") as f:
                    f.write(json.dumps({"op": name, "rank": os.environ.get("RANK"),
                                        "start": start, "end": time.time(),
                                        "files": len(items)}) + "\\n")
        return run

    _o.upload = _timed("upload", _o.upload)
    _o.download = _timed("download", _o.download)

    import launcher.engines as _e
    _spec = _e.spec

    class _TimedSpec:
        def __init__(self, spec):
            self._spec = spec

        def __getattr__(self, name):
            return getattr(self._spec, name)

        def build(self, *args, **kwargs):
            start = time.time()
            try:
                return self._spec.build(*args, **kwargs)
            finally:
                with open(os.environ["TW_BENCH_TIMES"], "a") as f:
                    f.write(json.dumps({"op": "build", "rank": os.environ.get("RANK"),
                                        "start": start, "end": time.time(), "files": 1}) + "\\n")

    _e.spec = lambda name: _TimedSpec(_spec(name))

if os.environ.get("TW_BENCH_SEQUENTIAL"):  # --resume-ab's other arm: download, then build
    from launcher.runtime import checkpoint_store as _cs
    _locate = _cs.locate_resume

    def _landed_first(*args, **kwargs):
        found = _locate(*args, **kwargs)
        return found.landed() if found is not None else found

    _cs.locate_resume = _landed_first
'''
"""A sitecustomize for the runs: times each rank's ``objectstore.upload``/``download`` call."""
EXTRA_HOOK = ""
"""``--hook``'s code, run before :data:`TIMING_HOOK` in every run's processes."""
SERVER_CPUS: set = set()
"""``--server-cpus``: the cores the server runs on (all of its threads); empty: any core."""


class BenchS3(s3h.SeaweedS3):
    """tests/helpers/s3.py's server with 1 GB volumes and as many as the disk holds (the tests'
    32 x 256 MB fill up within a few GB-sized saves); :meth:`vacuum` reclaims deleted bytes."""

    def start(self, timeout_s: float = 60.0) -> "BenchS3":
        ports = [f"-{name if '.' in name or name == 'metricsPort' else name + '.port'}={port}"
                 for name, port in self.ports.items()]
        args = [s3h.weed_binary(), "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3", f"-s3.config={self.root / 's3.json'}", *ports,
                "-s3.autoCreateBucket=false", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=1024", "-volume.max=0"]
        env = {k: v for k, v in os.environ.items() if k != s3h.MARK}
        cpus = SERVER_CPUS
        self.proc = subprocess.Popen(args, stdout=open(self.root / "weed.log", "ab"),
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus))
                                     if cpus else None)
        self._wait_until_up(timeout_s)
        return self

    def vacuum(self) -> None:
        url = f"http://127.0.0.1:{self.ports['master']}/vol/vacuum?garbageThreshold=0.0001"
        urllib.request.urlopen(url, timeout=600).read()


def clear(server: BenchS3, prefix: str) -> None:
    """Delete everything under ``prefix`` (and its unfinished multipart uploads), then vacuum."""
    objectstore.delete_folder(ObjectURI(BUCKET, prefix), time.monotonic() + 600)
    server.vacuum()


# --- 1. clients ------------------------------------------------------------------------------

def make_files(root: Path, count: int, size: int) -> list:
    root.mkdir(parents=True, exist_ok=True)
    block, files = os.urandom(min(size, 64 << 20)), []
    for i in range(count):
        path = root / f"f{i:02d}.bin"
        if not path.exists() or path.stat().st_size != size:
            with open(path, "wb") as f:
                for start in range(0, size, len(block)):
                    f.write(os.urandom(min(len(block), size - start)))
        files.append(path)
    return files


def _split(inflight: int, files: list) -> tuple:
    """(files in flight at once, parts in flight per file) for an in-flight budget."""
    threads = min(len(files), inflight)
    return threads, max(1, inflight // threads)


class Boto3:
    name = "boto3 (s3transfer TransferManager)"

    def __init__(self, endpoint: str, inflight: int):
        import boto3
        from botocore.config import Config
        from s3transfer.manager import TransferConfig

        self.client = boto3.client("s3", config=Config(
            max_pool_connections=inflight * 2, s3={"addressing_style": "path"}))
        self.config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                     max_request_concurrency=inflight)

    def put(self, files: list, prefix: str) -> None:
        from s3transfer.manager import TransferManager

        with TransferManager(self.client, self.config) as tm:
            for f in [tm.upload(str(p), BUCKET, f"{prefix}/{p.name}") for p in files]:
                f.result()

    def get(self, files: list, prefix: str, out: Path) -> None:
        from s3transfer.manager import TransferManager

        with TransferManager(self.client, self.config) as tm:
            for f in [tm.download(BUCKET, f"{prefix}/{p.name}", str(out / p.name))
                      for p in files]:
                f.result()


class Obstore:
    name = "obstore (put multipart, get_ranges)"

    def __init__(self, endpoint: str, inflight: int):
        from obstore.store import S3Store

        self.inflight = inflight
        self.store = S3Store(BUCKET, endpoint=endpoint, region="us-east-1",
                             access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                             secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                             virtual_hosted_style_request=False,
                             client_options={"allow_http": True})

    def put(self, files: list, prefix: str) -> None:
        import obstore

        threads, per_file = _split(self.inflight, files)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: obstore.put(self.store, f"{prefix}/{p.name}", p,
                                                chunk_size=PART, max_concurrency=per_file),
                          files))

    def get(self, files: list, prefix: str, out: Path) -> None:
        import obstore

        def one(p: Path) -> None:
            size = p.stat().st_size
            starts = list(range(0, size, PART))
            parts = obstore.get_ranges(self.store, f"{prefix}/{p.name}", starts=starts,
                                       ends=[min(s + PART, size) for s in starts], coalesce=0)
            with open(out / p.name, "wb") as f:
                for part in parts:
                    f.write(memoryview(part))

        threads, _ = _split(self.inflight, files)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, files))


class S3TorchConnector:
    name = "s3torchconnector (CRT S3Writer/S3Reader)"

    def __init__(self, endpoint: str, inflight: int):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        self.inflight = inflight
        self.client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(
            part_size=PART, force_path_style=True))

    def put(self, files: list, prefix: str) -> None:
        def one(p: Path) -> None:
            writer = self.client.put_object(BUCKET, f"{prefix}/{p.name}")
            with open(p, "rb") as f:
                while block := f.read(PART):
                    writer.write(block)
            writer.close()

        threads, _ = _split(self.inflight, files)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, files))

    def get(self, files: list, prefix: str, out: Path) -> None:
        def one(p: Path) -> None:
            reader = self.client.get_object(BUCKET, f"{prefix}/{p.name}")
            with open(out / p.name, "wb") as f:
                while block := reader.read(PART):
                    f.write(block)

        threads, _ = _split(self.inflight, files)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, files))


def compare_clients(server: BenchS3, work: Path, reps: int, inflight: int) -> dict:
    sets = {"4 x 256 MiB": make_files(work / "set_large", 4, 256 << 20),
            "16 x 32 MiB": make_files(work / "set_small", 16, 32 << 20)}
    out = {}
    for label, files in sets.items():
        nbytes = sum(p.stat().st_size for p in files)
        for kind in (Boto3, Obstore, S3TorchConnector):
            row = {"set": label, "client": kind.name, "bytes": nbytes, "put_s": [], "get_s": []}
            try:
                client = kind(server.endpoint, inflight)
                got = work / "got"
                for rep in range(reps):
                    shutil.rmtree(got, ignore_errors=True)
                    got.mkdir()
                    start = time.perf_counter()
                    client.put(files, f"clients/{kind.__name__}")
                    row["put_s"].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    client.get(files, f"clients/{kind.__name__}", got)
                    row["get_s"].append(time.perf_counter() - start)
                    assert sum(p.stat().st_size for p in got.iterdir()) == nbytes
                row["put_gbps"] = nbytes / 1e9 / min(row["put_s"])
                row["get_gbps"] = nbytes / 1e9 / min(row["get_s"])
            except Exception as exc:  # noqa: BLE001 - a client that cannot run is a result
                row["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            print(f"  {label:12} {kind.name:42} " + (
                f"put {row['put_gbps']:.3f} GB/s  get {row['get_gbps']:.3f} GB/s"
                if "error" not in row else f"FAILED: {row['error']}"), flush=True)
            out.setdefault(label, []).append(row)
            clear(server, f"clients/{kind.__name__}")
    shutil.rmtree(work / "got", ignore_errors=True)
    return out


# --- 2c. raw rates of the staged files, 2 processes -------------------------------------------

def _raw_worker(mode: str, inflight: int, direction: str, items: list, barrier, queue) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from s3transfer.manager import TransferConfig as ManagerConfig
    from s3transfer.manager import TransferManager

    pool = inflight * 2 if mode == "shared" else objectstore.CONCURRENCY * 2
    client = boto3.client("s3", config=Config(max_pool_connections=pool,
                                              s3={"addressing_style": "path"}))
    barrier.wait()
    start = time.time()
    error = ""
    try:
        if mode == "shared":
            config = ManagerConfig(multipart_threshold=objectstore.PART_BYTES,
                                   multipart_chunksize=objectstore.PART_BYTES,
                                   max_request_concurrency=inflight)
            with TransferManager(client, config) as tm:
                futures = [tm.upload(str(local), BUCKET, key) if direction == "put"
                           else tm.download(BUCKET, key, str(local)) for local, key in items]
                for f in futures:
                    f.result()
        else:  # as launcher.core.objectstore: a transfer per file, 4 files at once
            config = TransferConfig(multipart_threshold=objectstore.PART_BYTES,
                                    multipart_chunksize=objectstore.PART_BYTES,
                                    max_concurrency=objectstore.CONCURRENCY, use_threads=True)

            def one(item):
                local, key = item
                if direction == "put":
                    client.upload_file(str(local), BUCKET, key, Config=config)
                else:
                    Path(local).parent.mkdir(parents=True, exist_ok=True)
                    client.download_file(BUCKET, key, str(local), Config=config)

            with ThreadPoolExecutor(max(1, min(4, len(items)))) as threads:
                list(threads.map(one, items))
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    queue.put((start, time.time(), error))


def raw_transfer(mode: str, inflight: int, direction: str, shares: list) -> tuple:
    """Seconds from the first process's start to the last one's end; an error or ''."""
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(len(shares)), ctx.Queue()
    procs = [ctx.Process(target=_raw_worker, args=(mode, inflight, direction, items, barrier,
                                                   queue)) for items in shares]
    for p in procs:
        p.start()
    got = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    errors = [e for _, _, e in got if e]
    return max(e for _, e, _ in got) - min(s for s, _, _ in got), errors[0] if errors else ""


RAW_MODES = (("as-objectstore", 0), ("shared", 8), ("shared", 16))


def _gbps(rate) -> str:
    return "failed" if rate is None else f"{rate:.3f} GB/s"


def _num(rate) -> str:
    return "failed" if rate is None else f"{rate:.3f}"


def raw_rates(server: BenchS3, step_dir: Path, files: dict, work: Path, reps: int,
              modes: tuple, ranks: int = 2) -> dict:
    """put and get GB/s of ``files`` (name -> bytes, under ``step_dir``) for each raw mode,
    best of ``reps``; the shares are our ranks' (the upload's assign, the fetch's split)."""
    from launcher.runtime.checkpoint_store import assign

    nbytes = sum(files.values())
    puts = assign([files] * ranks)
    names = sorted(files, key=lambda n: (-files[n], n))
    gets = [names[r::ranks] for r in range(ranks)]
    out = {}
    for mode, inflight in modes:
        label = mode if mode != "shared" else f"TransferManager, {inflight} in flight/process"
        row = {"put_s": [], "get_s": [], "errors": []}
        for rep in range(reps if mode == "shared" else 1):
            got = work / "rawget"
            shutil.rmtree(got, ignore_errors=True)
            for n in files:
                (got / n).parent.mkdir(parents=True, exist_ok=True)
            seconds, error = raw_transfer(mode, inflight, "put", [
                [(step_dir / n, f"raw/{n}") for n in share] for share in puts])
            if error:  # a failed put (the server's InternalError under load): no rate, no get
                row["errors"].append(f"put: {error}")
            else:
                row["put_s"].append(seconds)
                seconds, error = raw_transfer(mode, inflight, "get", [
                    [(got / n, f"raw/{n}") for n in share] for share in gets])
                if error:
                    row["errors"].append(f"get: {error}")
                else:
                    row["get_s"].append(seconds)
            clear(server, "raw")
        row["put_gbps"] = nbytes / 1e9 / min(row["put_s"]) if row["put_s"] else None
        row["get_gbps"] = nbytes / 1e9 / min(row["get_s"]) if row["get_s"] else None
        print(f"    raw {label:42} put {_gbps(row['put_gbps'])}  get {_gbps(row['get_gbps'])}"
              + (f"  ({len(row['errors'])} failed: {row['errors'][0]})" if row["errors"] else ""),
              flush=True)
        out[label] = row
    shutil.rmtree(work / "rawget", ignore_errors=True)
    return out


# --- 2. our save and load ----------------------------------------------------------------------

def train(work: Path, name: str, overrides: list, env: dict, steps: int,
          stop_after_row: int = 0) -> Path:
    """One launcher.train run (the timing hook on its PYTHONPATH); its run directory.
    ``stop_after_row``: SIGKILL the run's process group once that step's metrics row exists."""
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(EXTRA_HOOK + "\n" + TIMING_HOOK)
    run_dir = work / "runs" / name
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                "TW_BENCH_TIMES": str(work / f"{name}.times.jsonl"),
                "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    args = [sys.executable, "-m", "launcher.train", *COMMON, *overrides,
            f"trainer.train_steps={steps}", f"run.output_root={work / 'runs'}", f"run.name={name}"]
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if stop_after_row and stop_after_row in metric_rows(run_dir):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return run_dir
            time.sleep(0.2)
    if proc.returncode != 0:
        tail = [line for line in (work / f"{name}.log").read_text().splitlines()
                if line.startswith(("[checkpoint]", "launcher:", "train:"))]
        raise RunFailed(f"{name}: launcher.train exited {proc.returncode}: "
                        + " / ".join(tail[-4:])[-1500:])
    return run_dir


class RunFailed(Exception):
    """A launcher.train run of the bench that did not finish (its exit code and last lines)."""


def events(run_dir: Path, kind: str) -> list:
    rows = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def metric_rows(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # being written
        if "loss" in row:
            rows[row["step"]] = row
    return rows


def window(work: Path, name: str, op: str) -> float:
    """Seconds from the first rank's ``op`` start to the last rank's end (the timing hook)."""
    path = work / f"{name}.times.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    rows = [r for r in rows if r["op"] == op and r["files"]]
    return max(r["end"] for r in rows) - min(r["start"] for r in rows) if rows else 0.0


def first_start(work: Path, name: str, op: str) -> float:
    """When the first rank's ``op`` began (the timing hook's clock: time.time)."""
    rows = [json.loads(x) for x in (work / f"{name}.times.jsonl").read_text().splitlines()]
    return min(r["start"] for r in rows if r["op"] == op and r["files"])


def saved_event(run_dir: Path) -> dict:
    found = [e for e in events(run_dir, "checkpoint") if " saved" in e["message"]]
    if not found:
        failed = [e["message"] for e in events(run_dir, "checkpoint")]
        raise RunFailed(f"{run_dir.name}: no save: {failed}")
    return found[0]


def ours(server: BenchS3, work: Path, model: str, reps: int, raw_modes: tuple,
         do_async: bool) -> dict:
    env = server.env()
    over = MODELS[model]
    uri = f"s3://{BUCKET}/ours/{model}"
    print(f"\n{model}: {' '.join(over)} ({' '.join(COMMON[:5])})", flush=True)

    local = saved_event(train(work, f"{model}-local", over, env, 1))
    build_s = window(work, f"{model}-local", "build")
    shutil.rmtree(work / "runs" / f"{model}-local")  # the disk holds a few states, not all
    print(f"  local save (staging write): {local['bytes'] / 1e9:.2f} GB in "
          f"{local['seconds']:.1f} s", flush=True)

    store_dir = train(work, f"{model}-store", [*over, f"trainer.checkpoint_uri={uri}"], env, 1)
    save = saved_event(store_dir)
    upload_s = window(work, f"{model}-store", "upload")
    record = json.loads(server.client().get_object(
        Bucket=BUCKET, Key=f"ours/{model}/{STEP}/complete")["Body"].read())
    print(f"  our save to the store: {save['bytes'] / 1e9:.2f} GB in {save['seconds']:.1f} s "
          f"(upload window {upload_s:.1f} s)", flush=True)

    raw = raw_rates(server, store_dir / "checkpoints" / STEP, record["files"], work, reps,
                    raw_modes)
    shutil.rmtree(store_dir)

    load_dir = train(work, f"{model}-load", [*over, f"trainer.load={uri}/{STEP}"], env, 2)
    loaded = [e for e in events(load_dir, "checkpoint") if " loaded" in e["message"]][0]
    download_s = window(work, f"{model}-load", "download")
    load_s = loaded["time"] - first_start(work, f"{model}-load", "download") - build_s
    shutil.rmtree(load_dir)
    print(f"  our load from the store: {load_s:.1f} s beyond the engine's build ({build_s:.1f} s "
          f"when saving locally); download window {download_s:.1f} s, engine read (with the "
          f"wait for the download's end) {loaded['seconds']:.1f} s", flush=True)

    nbytes = record["bytes"]
    best_put = max(r["put_gbps"] or 0.0 for r in raw.values()) or float("nan")
    best_get = max(r["get_gbps"] or 0.0 for r in raw.values()) or float("nan")
    result = {
        "overrides": over, "bytes": nbytes, "files": len(record["files"]),
        "local_save_s": local["seconds"], "save_s": save["seconds"], "upload_s": upload_s,
        "download_s": download_s, "engine_load_s": loaded["seconds"], "build_s": build_s,
        "load_s": load_s, "raw": raw,
        "raw_put_gbps": best_put, "raw_get_gbps": best_get,
        "save_gbps": nbytes / 1e9 / save["seconds"], "upload_gbps": nbytes / 1e9 / upload_s,
        "download_gbps": nbytes / 1e9 / download_s,
        "load_gbps": nbytes / 1e9 / load_s,
    }
    result.update(save_vs_raw=result["save_gbps"] / best_put,
                  upload_vs_raw=result["upload_gbps"] / best_put,
                  download_vs_raw=result["download_gbps"] / best_get,
                  load_vs_raw=result["load_gbps"] / best_get)
    clear(server, f"ours/{model}")
    if do_async:
        result["async"] = async_stall(server, work, model, env, local["seconds"])
    shutil.rmtree(work / "runs" / f"{model}-async", ignore_errors=True)
    return result


def resume_ab(server: BenchS3, work: Path, model: str, pairs: int) -> list:
    """``pairs`` resumes from one committed step, alternating: the download during the build
    (as launcher.train does it) and the download landed before the build
    (``TW_BENCH_SEQUENTIAL``); seconds from the first request to the ``loaded`` event of each,
    and that less the local run's build."""
    env, over = server.env(), MODELS[model]
    uri = f"s3://{BUCKET}/ab/{model}"
    local = train(work, f"{model}-ab-local", over, env, 1)
    build_s = window(work, f"{model}-ab-local", "build")
    shutil.rmtree(local)
    shutil.rmtree(train(work, f"{model}-ab-store", [*over, f"trainer.checkpoint_uri={uri}"],
                        env, 1))
    rows = []
    for rep in range(pairs):
        for arm in ("overlapped", "sequential"):
            name = f"{model}-ab-{arm}-{rep}"
            extra = {"TW_BENCH_SEQUENTIAL": "1"} if arm == "sequential" else {}
            run_dir = train(work, name, [*over, f"trainer.load={uri}/{STEP}"], {**env, **extra}, 2)
            loaded = [e for e in events(run_dir, "checkpoint") if " loaded" in e["message"]][0]
            wall = loaded["time"] - first_start(work, name, "download")
            rows.append({"arm": arm, "rep": rep, "first_request_to_loaded_s": round(wall, 2),
                         "beyond_build_s": round(wall - build_s, 2),
                         "download_s": round(window(work, name, "download"), 2),
                         "build_s": round(window(work, name, "build"), 2),
                         "engine_read_s": loaded["seconds"]})
            print(f"  resume {arm:10} {rows[-1]}", flush=True)
            shutil.rmtree(run_dir)
    clear(server, f"ab/{model}")
    return rows


def async_stall(server: BenchS3, work: Path, model: str, env: dict, staging_s: float) -> dict:
    """engine=megatron, async_save, saving every 3 steps: the checkpoint phase of rows 3 (the
    save call), 4 and 5 (the polls: the one that finds every rank's write done starts the
    upload) against the sync staging write; SIGKILLed once row 5 is written (before step 6's
    save, which would wait for the upload)."""
    name = f"{model}-async"
    uri = f"s3://{BUCKET}/async/{model}"
    run_dir = train(work, name, [*MODELS[model], "trainer.async_save=true",
                                 "trainer.save_interval=3", f"trainer.checkpoint_uri={uri}"],
                    env, 7, stop_after_row=5)
    rows = metric_rows(run_dir)
    times = work / f"{name}.times.jsonl"
    starts = [json.loads(x)["start"] for x in times.read_text().splitlines()
              if '"upload-start"' in x] if times.exists() else []
    out = {"staging_s": staging_s,
           "checkpoint_phase_s": {s: rows[s]["time/checkpoint"] for s in sorted(rows)},
           "step_time_s": {s: rows[s]["step_time"] for s in sorted(rows)},
           "upload_started_by_row_5": bool(starts) and 5 in rows and
           max(starts) <= rows[5]["time"]}
    out["stall_s"] = max(rows[s]["time/checkpoint"] for s in (3, 4, 5) if s in rows)
    out["stall_vs_staging"] = out["stall_s"] / staging_s
    print(f"  async save: checkpoint phase by step {out['checkpoint_phase_s']} s (upload started "
          f"by row 5: {out['upload_started_by_row_5']}); local staging {staging_s:.1f} s",
          flush=True)
    clear(server, f"async/{model}")
    return out


# --- report --------------------------------------------------------------------------------------

def host() -> dict:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:  # only the client comparison needs it
            return "not installed"

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    weed = subprocess.run([s3h.weed_binary(), "version"], capture_output=True,
                          text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem, 1),
            "python": platform.python_version(), "load_average_at_start": os.getloadavg(),
            "server_cpus": sorted(SERVER_CPUS), "client_cpus": sorted(os.sched_getaffinity(0)),
            "server": weed.splitlines()[0] if weed else "weed",
            **{name: version(name) for name in ("boto3", "obstore", "s3torchconnector")}}


def print_tables(result: dict) -> None:
    if result.get("clients"):
        print("\n| set | client | put GB/s | get GB/s |\n|---|---|---|---|")
        for label, rows in result["clients"].items():
            for r in rows:
                if "error" in r:
                    print(f"| {label} | {r['client']} | failed: {r['error'][:80]} | |")
                else:
                    print(f"| {label} | {r['client']} | {r['put_gbps']:.3f} | "
                          f"{r['get_gbps']:.3f} |")
    print("\n| model | state GB | local save s | raw put GB/s | our save s (upload after the "
          "write s) | save GB/s | save / raw | raw get GB/s | our download s | download / raw "
          "| engine read s (with its wait) | build s | our load s (beyond the build) | load / raw |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    done = {m: r for m, r in result["models"].items() if "failed" not in r}
    for model, r in result["models"].items():
        if model not in done:
            print(f"| {model} | failed: {r['failed'][:200]} |")
    for model, r in done.items():
        print(f"| {model} | {r['bytes'] / 1e9:.2f} | {r['local_save_s']:.1f} | "
              f"{r['raw_put_gbps']:.3f} | {r['save_s']:.1f} ({r['upload_s']:.1f}) | "
              f"{r['save_gbps']:.3f} | {r['save_vs_raw']:.0%} | "
              f"{r['raw_get_gbps']:.3f} | {r['download_s']:.1f} | {r['download_vs_raw']:.0%} | "
              f"{r['engine_load_s']:.1f} | {r['build_s']:.1f} | {r['load_s']:.1f} | "
              f"{r['load_vs_raw']:.0%} |")
    print("\n| model | raw transfer (2 processes) | put GB/s | get GB/s | failed tries |\n"
          "|---|---|---|---|---|")
    for model, r in done.items():
        for label, row in r["raw"].items():
            print(f"| {model} | {label} | {_num(row['put_gbps'])} | {_num(row['get_gbps'])} | "
                  f"{len(row['errors'])} |")
    for model, r in done.items():
        if "async" in r:
            a = r["async"]
            print(f"\n{model}, trainer.async_save=true: the loop's checkpoint phase by step "
                  + ", ".join(f"{s}: {v:.2f} s" for s, v in a["checkpoint_phase_s"].items())
                  + f"; stall {a['stall_s']:.2f} s = {a['stall_vs_staging']:.0%} of the local "
                  f"staging write ({a['staging_s']:.1f} s)")


def pin_cores(server_cpus: set) -> None:
    """Give the server ``server_cpus`` alone: this process (and so every client and rank it
    starts) runs on the other cores."""
    global SERVER_CPUS
    if not server_cpus:
        return
    rest = os.sched_getaffinity(0) - server_cpus
    if not rest or not server_cpus <= os.sched_getaffinity(0):
        sys.exit(f"--server-cpus={sorted(server_cpus)}: this process may run on "
                 f"{sorted(os.sched_getaffinity(0))}; name some of them and leave one at least")
    SERVER_CPUS = server_cpus
    os.sched_setaffinity(0, rest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/tw_s3ckpt")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=16,
                    help="parts in flight in the client comparison (one process)")
    ap.add_argument("--models", default="gpt2_124m,wide")
    ap.add_argument("--skip-clients", action="store_true")
    ap.add_argument("--skip-async", action="store_true")
    ap.add_argument("--as-objectstore", choices=("all", "first", "none"), default="first",
                    help="which models also get the raw rate with objectstore's own settings "
                         "(one try: slow where they overload the server)")
    ap.add_argument("--hook", type=Path,
                    help="Python run at the start of every launcher.train process of the bench "
                         "(a sitecustomize), e.g. a prototype of a change to "
                         "launcher.core.objectstore measured before it is made")
    ap.add_argument("--resume-ab", type=int, default=0, metavar="PAIRS",
                    help="also resume each model PAIRS times each way, alternating: the "
                         "download during the engine's build, and landed before it")
    ap.add_argument("--server-cpus", default="",
                    help="cores for the server alone, e.g. 0 (the bench, its clients and the "
                         "ranks get the others): a store whose CPU is not the node's")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "s3_checkpoint.json")
    args = ap.parse_args()
    global EXTRA_HOOK
    EXTRA_HOOK = args.hook.read_text() if args.hook else ""
    pin_cores({int(c) for c in args.server_cpus.split(",") if c.strip()})
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    free_gb = shutil.disk_usage(work).free / 1e9
    if free_gb < 30:
        print(f"warning: {free_gb:.0f} GB free under {work}; the wide model needs about 25 GB "
              "at its peak (its states locally and on the server)", flush=True)
    server = BenchS3(work / "seaweed").start()
    try:
        server.bucket(BUCKET)
        os.environ.update(server.env())  # the AWS chain of this process and its children
        result = {"host": host(), "reps": args.reps, "inflight": args.inflight,
                  "part_bytes": PART, "objectstore": {"PART_BYTES": objectstore.PART_BYTES,
                                                      "CONCURRENCY": objectstore.CONCURRENCY},
                  "hook": str(args.hook or ""), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        print(f"host: {result['host']}", flush=True)
        if not args.skip_clients:
            print(f"\nclients ({args.inflight} parts of {PART >> 20} MiB in flight, one "
                  f"process, best of {args.reps}):", flush=True)
            result["clients"] = compare_clients(server, work, args.reps, args.inflight)
        result["models"] = {}
        for i, model in enumerate(args.models.split(",")):
            modes = RAW_MODES if (args.as_objectstore == "all" or
                                  (args.as_objectstore == "first" and i == 0)) else RAW_MODES[1:]
            try:
                result["models"][model] = ours(server, work, model, args.reps, modes,
                                               do_async=not args.skip_async and i == 0)
                if args.resume_ab:
                    result["models"][model]["resume_ab"] = resume_ab(server, work, model,
                                                                     args.resume_ab)
            except RunFailed as exc:  # a result too: which run, how it ended, its log's tail
                print(f"  FAILED: {exc}", flush=True)
                result["models"][model] = {"overrides": MODELS[model], "failed": str(exc)}
                shutil.rmtree(work / "runs", ignore_errors=True)
                for prefix in ("ours", "async", "raw"):
                    clear(server, prefix)
        result["load_average_at_end"] = os.getloadavg()
        print_tables(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwritten: {args.out}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
