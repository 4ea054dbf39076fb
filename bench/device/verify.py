"""The device side of a GPU window: ``bash bench/device/verify.sh`` runs this file.

Each call of the device tool runs it once, from the repository root, with that call's bundle
(``.whl/callK/``, laid out by ``bash bench/device/prepare.sh`` on a machine with a package index)
in the call's carry, or with no carry at all once every bundle has arrived. It:

1. stashes what arrived in a persistent spot (``/tmp/tw-verify``, kept while the machine stays
   warm), checking each file's size and sha256 against the bundle's manifest;
2. joins the parts of every item whose parts are all in, checks the sha256 of the joined and of
   the decompressed file, and installs, with pip, every group that is complete: ``base`` (the
   wheels of bench/device/gpu-wheels.txt and data_prep-wheels.txt into ``/tmp/tw-verify/site``)
   and Transformer Engine (its core and meta wheels into ``/tmp/tw-verify/site-te``);
3. runs the steps whose packages are in, most valuable first (:data:`STEPS`), each under its own
   timeout and within this call's time (``TW_CALL_BUDGET_S``, 570 s: the device tool stops a
   command at 600 s): ``probe`` (bench/device/probe_check.py: the machine probe, the catalogue
   and the calibrated plan against runs), ``gpu_layouts`` (tests/test_gpu_layouts.py without
   Transformer Engine), ``checkpoint_speed`` (bench/checkpoint_speed.py, two ranks on the GPU,
   against the disk), ``data_prep_scaling`` (bench/device/data_prep_scaling.sh, the 16-core
   table), ``te_torch`` (Transformer Engine's PyTorch extension: carried prebuilt, else compiled
   from its sdist for the GPU's architecture) and ``gpu_tests`` (tests/test_gpu_fp8.py,
   tests/test_gpu_context_parallel.py, tests/test_gpu_chat_thd.py and the layouts the first pass
   skipped, with TE). A step
   that waits for packages still on their way is passed over, so the first call already runs
   what its bundle allows;
4. writes ``$OUT/summary.md`` (versions, every step and test with its outcome, the numbers, and
   what the next call must carry), ``$OUT/state.json`` and ``$OUT/logs.tar.gz`` after every step.

Resumable: progress is kept in ``/tmp/tw-verify/state.json``; a call that runs out of time stops
before its limit and the next call goes on (a pytest pass deselects the tests already reported).
A fresh machine (the last one went back) starts from ``.whl/resume/state.json`` when the caller
carries the last ``$OUT/state.json`` there; the summary then says which bundles to send again.

Exit status: 0 complete with every step passed; 10 not complete (make the next call the summary
names); 1 complete with a failure, or nothing to work with.

Environment: TW_CALL_BUDGET_S (570), TW_XDIST (pytest workers, 4), TW_VERIFY_SKIP and
TW_VERIFY_ONLY (comma-separated step names), TW_CKPT_ARGS (more checkpoint_speed.py arguments),
TW_DATA_PREP_ARGS (replace data_prep_scaling.sh's), TW_VERIFY_DIR (/tmp/tw-verify). For tests of
this file without a GPU: TW_VERIFY_DRY=1 (stash, join, install and the pytest pass for real, the
other steps as stand-ins of TW_DRY_STEP_S seconds) and TW_VERIFY_TIME_SCALE (multiplies every
step's time estimate, minimum and timeout).
"""

from __future__ import annotations

import argparse
import datetime
import json
import lzma
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from files import sha256  # bench/device/files.py (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
WHL = ROOT / ".whl"
WORK = Path(os.environ.get("TW_VERIFY_DIR", "/tmp/tw-verify"))
STASH, READY, SITE, SITE_TE, LOGS = (WORK / "stash", WORK / "ready", WORK / "site",
                                     WORK / "site-te", WORK / "logs")
PLUGIN_DIR = ROOT / "bench" / "device" / "pytest_plugin"
PY = sys.executable
DRY = os.environ.get("TW_VERIFY_DRY") == "1"
SCALE = float(os.environ.get("TW_VERIFY_TIME_SCALE", "1"))
MARGIN_S = 20.0
"""Kept free at the end of a call to write the summary and the logs."""
FINAL = {"pass", "fail", "timeout", "skipped", "error"}
GPU_TEST_FILES = ("tests/test_gpu_fp8.py", "tests/test_gpu_context_parallel.py",
                  "tests/test_gpu_chat_thd.py", "tests/test_gpu_layouts.py",
                  "tests/test_gpu_probe.py")
"""In this order, so that xdist hands out the two long module fixtures first."""
TE_FREE_TEST_FILES = ("tests/test_gpu_layouts.py", "tests/test_gpu_probe.py")
"""The ``gpu_layouts`` pass (without Transformer Engine)."""
RUN_ID = f"{os.getpid()}-{int(time.time())}"
"""Part of every TW_VERIFY_RUN marker of this run's processes."""
OUT_PART_BYTES = 15 << 20
"""The device tool brings back files of at most 16 MiB, 8 files in all."""


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    needs: tuple
    """'base': the base wheels installed; 'te-core': Transformer Engine's core installed;
    'te': Transformer Engine settled (its extension in, failed, or not in the bundle)."""
    est_s: int
    """Expected seconds (for the plan and for prepare.sh's estimate)."""
    min_s: int
    """Not started with less time left in the call."""
    timeout_s: int
    machine: bool = False
    """Its result is a property of this machine (an install), not a measurement: a fresh machine
    does it again."""


STEPS = (
    Step("probe", "the machine probe on the GPU; the catalogue and the calibrated plan against "
         "runs", ("base",), 200, 150, 360),
    Step("gpu_layouts", "every layout through launcher.train, 2 ranks on the GPU, without "
         "Transformer Engine", ("base",), 300, 150, 480),
    Step("checkpoint_speed", "checkpoint save/load GB/s against the disk, 2 ranks on the GPU",
         ("base",), 150, 150, 300),
    Step("data_prep_scaling", "data_prep's scaling table on all cores",
         ("base",), 330, 360, 540),
    Step("te_torch", "Transformer Engine's PyTorch extension (prebuilt, or compiled here)",
         ("te-core",), 300, 120, 540, machine=True),
    Step("gpu_tests", "GPU tests with Transformer Engine: FP8 and the fused loss, context "
         "parallel, packed chat rows (THD), the layouts that need it", ("base", "te"), 390, 180,
         540),
)
"""Most valuable first, as a window of 15 minutes (one bundle call and one more) can pay: the
probe (the plan's calibration, the shortest) and the multi-rank layouts need no Transformer Engine; TE's extension and its tests come
last (later windows carry its bundles)."""
STEP = {s.name: s for s in STEPS}
PREBUILT_EST_S = 30
INSTALL_EST_S = {"base": 60, "te-core": 40, "call": 15}
"""Expected seconds of the install phase: the base wheels, Transformer Engine's core, and any
call's stashing and checks."""


# ---------------------------------------------------------------------------------------------
# helpers

def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def say(msg: str) -> None:
    print(f"[verify {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    with open(LOGS / "verify.log", "a") as f:
        f.write(f"{now()} {msg}\n")


def out_dir() -> Path:
    out = Path(os.environ.get("OUT") or WORK / "out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def kill_marked(marker: str, exact: bool = True) -> int:
    """SIGKILL every process whose environment carries TW_VERIFY_RUN=marker: the step's own
    processes, also those that left its process group (launcher.train starts its runs in new
    sessions, and a killed pytest leaves them running). ``exact=False``: any marker that starts
    with ``marker`` ('' at the start of a run: what an earlier run, stopped from outside, left)."""
    needle = f"TW_VERIFY_RUN={marker}".encode() + (b"\0" if exact else b"")
    killed = 0
    for _ in range(3):
        found = False
        for d in Path("/proc").glob("[0-9]*"):
            pid = int(d.name)
            if pid in (os.getpid(), os.getppid()):
                continue
            try:
                if needle in (d / "environ").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                    found = True
            except (OSError, ProcessLookupError):
                continue
        if not found:
            break
        time.sleep(1)
    return killed


def run(cmd: list, log: Path, timeout: float, env: dict, marker: str, cwd: Path = ROOT):
    """Run ``cmd`` (output appended to ``log``) for at most ``timeout`` s; (rc or None, seconds)."""
    start = time.monotonic()
    env = {**env, "TW_VERIFY_RUN": marker}
    with open(log, "a") as out:
        out.write(f"\n$ {shlex.join(map(str, cmd))}\n# {now()}, timeout {timeout:.0f} s\n")
        out.flush()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        seconds = time.monotonic() - start
        out.write(f"# exit {rc if rc is not None else 'timeout'} after {seconds:.1f} s\n")
    killed = kill_marked(marker)
    if killed:
        with open(log, "a") as out:
            out.write(f"# killed {killed} leftover process(es) of this step\n")
    return rc, seconds


def step_env(te: bool = True) -> dict:
    paths = [str(SITE)]
    if te and SITE_TE.is_dir():
        paths.append(str(SITE_TE))
    old = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + ([old] if old else [])),
               PYTHONUNBUFFERED="1", WANDB_MODE="disabled", TW_VERIFY_SITE=str(SITE))
    return env


# ---------------------------------------------------------------------------------------------
# manifest, state

def load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def carried_manifests() -> list:
    return [m for m in (load_json(p) for p in sorted(WHL.glob("call*/manifest.json"))) if m]


def carried_calls() -> list:
    return sorted((p.name for p in WHL.glob("call*") if p.is_dir()),
                  key=lambda n: int(re.sub(r"\D", "", n) or 0))


def new_state(manifest) -> dict:
    return {"format": 1, "bundle": manifest and manifest["id"], "calls": [], "tests": {},
            "versions": "", "steps": {s.name: {"status": "pending", "attempts": 0,
                                               "seconds": 0.0, "note": ""} for s in STEPS},
            "te": {"torch_ext": "", "exported": False}}


def load_state(manifest) -> tuple:
    """(state, where it came from)."""
    state = load_json(WORK / "state.json")
    if state and (manifest is None or state.get("bundle") in (None, manifest["id"])):
        return state, "this machine"
    if state:
        say(f"the carried bundle {manifest['id']} is not the one of this machine's state "
            f"({state.get('bundle')}): starting over with it")
        for d in (STASH, READY, SITE, SITE_TE, WORK / "tetorch"):
            shutil.rmtree(d, ignore_errors=True)
        for d in (STASH, READY):
            d.mkdir(parents=True)
        return new_state(manifest), "new bundle"
    carried = load_json(WHL / "resume" / "state.json")
    if carried and (manifest is None or carried.get("bundle") == manifest["id"]):
        for step in STEPS:  # installs are this machine's: a fresh one does them again
            if step.machine:
                carried["steps"][step.name].update(status="pending", attempts=0)
        carried["te"] = {"torch_ext": "", "exported": carried.get("te", {}).get("exported")}
        return carried, "carried .whl/resume/state.json (a fresh machine)"
    if carried:
        say(f".whl/resume/state.json is of bundle {carried.get('bundle')}, not of the carried "
            f"{manifest['id']}: ignored")
    return new_state(manifest), "new"


# ---------------------------------------------------------------------------------------------
# arrival: stash, join, install

def stash(manifest, call: dict) -> None:
    parts = {p["file"]: p for item in manifest["items"] for p in item["parts"]}
    for d in carried_calls():
        for path in sorted((WHL / d).iterdir()):
            if path.name == "manifest.json":
                continue
            meta = parts.get(path.name)
            if meta is None:
                call["problems"].append(f"{d}/{path.name}: not in the manifest (ignored)")
                continue
            dest = STASH / path.name
            if dest.exists() and dest.stat().st_size == meta["bytes"]:
                continue  # checked when it was stashed
            if path.stat().st_size != meta["bytes"] or sha256(path) != meta["sha256"]:
                call["problems"].append(f"{d}/{path.name}: size or sha256 differs from the "
                                        f"manifest: send call {meta['call']} again")
                continue
            tmp = dest.with_suffix(dest.suffix + ".tmp")
            shutil.copyfile(path, tmp)
            tmp.rename(dest)
            call["stashed"].append(path.name)


def assemble(manifest, call: dict) -> None:
    for item in manifest["items"]:
        done = READY / (item["name"] + ".ok")
        if done.exists():
            continue
        parts = [STASH / p["file"] for p in item["parts"]]
        if not all(p.exists() for p in parts):
            continue
        target = READY / item["name"]
        encoded = WORK / "tmp" / item["encoded"]
        encoded.parent.mkdir(exist_ok=True)
        with open(encoded, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 8 << 20)
        if sha256(encoded) != item["encoded_sha256"]:
            call["problems"].append(f"{item['name']}: the joined parts' sha256 differs from the "
                                    f"manifest: send calls {item_calls(item)} again")
            for p in parts:
                p.unlink()
            encoded.unlink()
            continue
        if item["encoding"] == "xz":
            with lzma.open(encoded) as f, open(target, "wb") as out:
                shutil.copyfileobj(f, out, 8 << 20)
            encoded.unlink()
        else:
            encoded.rename(target)
        if sha256(target) != item["sha256"]:
            call["problems"].append(f"{item['name']}: sha256 after decompression differs from "
                                    "the manifest")
            target.unlink()
            continue
        done.touch()
        call["assembled"].append(item["name"])


def item_calls(item) -> str:
    return ", ".join(str(c) for c in sorted({p["call"] for p in item["parts"]}))


def group_items(manifest, *groups) -> list:
    return [i for i in (manifest or {}).get("items", []) if i["group"] in groups]


def is_ready(item) -> bool:
    return (READY / (item["name"] + ".ok")).exists()


def pip_install(files: list, target: Path, log: Path, upgrade: bool = True) -> bool:
    cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check", "--target", str(target)]
    rc, _ = run(cmd + (["--upgrade"] if upgrade else []) + [str(f) for f in files], log, 600,
                dict(os.environ), f"{RUN_ID}-pip")
    return rc == 0


def install(manifest, state, call: dict) -> None:
    """Installs each complete group once per machine (markers in the target folders)."""
    log = LOGS / "install.log"
    base = group_items(manifest, "base")
    if base and _install_group(base, SITE, "base", call, log):
        check_imports(call, log)
    elif base and not (SITE / ".tw-installed").exists() and all(map(is_ready, base)):
        call["problems"].append("pip could not install the base wheels: see install.log")
        for step in STEPS:  # nothing that needs them can run: settled, not waited for
            if "base" in step.needs and state["steps"][step.name]["status"] not in FINAL:
                state["steps"][step.name].update(
                    status="error", note="pip could not install the base wheels (install.log)")
    core = group_items(manifest, "te-core", "te-meta")
    if not core or state["steps"]["te_torch"]["status"] in FINAL:
        return
    if not _install_group(core, SITE_TE, "Transformer Engine core", call, log) \
            and not (SITE_TE / ".tw-installed").exists() and all(map(is_ready, core)):
        call["problems"].append("pip could not install Transformer Engine: see install.log")
        (WORK / "te-disabled").touch()  # the tests run as where TE is not installed
        state["steps"]["te_torch"].update(
            status="fail", note="pip could not install TE's core (install.log); the tests "
                                "run without Transformer Engine")


def _install_group(items: list, site: Path, label: str, call: dict, log: Path) -> bool:
    """Install a group into ``site`` once it has all arrived and is not installed yet, then
    byte-compile it (so that no timed run and no concurrent launch compiles it); True when this
    call installed it."""
    if (site / ".tw-installed").exists() or not all(map(is_ready, items)):
        return False
    start = time.monotonic()
    if not pip_install([READY / i["name"] for i in items], site, log):
        return False
    run([PY, "-m", "compileall", "-q", "-j", "0", str(site)], log, 300, dict(os.environ),
        f"{RUN_ID}-compileall")
    (site / ".tw-installed").touch()
    call["installed"].append(f"{label} ({len(items)} files, {time.monotonic() - start:.0f} s)")
    return True


BASE_IMPORTS = ("hydra", "omegaconf", "pydantic", "hjson", "submitit", "yaml", "orjson",
                "zlib_ng", "zstandard", "gigatoken", "tiktoken", "awkward", "pytest", "xdist",
                "pytest_timeout")
TORCH_IMPORTS = ("torch", "megatron.core", "deepspeed")


def check_imports(call: dict, log: Path) -> None:
    mods = BASE_IMPORTS + (() if DRY else TORCH_IMPORTS)
    code = ("import importlib, sys\nbad = []\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as e:\n"
            "        bad.append(f'{m}: {e!r}'[:300])\nprint('\\n'.join(bad) or 'all imported')\n"
            "sys.exit(1 if bad else 0)\n")
    with open(log, "a") as out:
        proc = subprocess.run([PY, "-c", code, *mods], env=step_env(te=False), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=out, text=True, timeout=300)
        out.write(proc.stdout)
    if proc.returncode != 0:
        call["problems"].append("imports failing after the install: "
                                + "; ".join(proc.stdout.splitlines()))


# ---------------------------------------------------------------------------------------------
# what can run

def te_in_bundle(manifest) -> bool:
    return bool(group_items(manifest, "te-core"))


def satisfied(manifest, state) -> set:
    sat = set()
    if (SITE / ".tw-installed").exists():
        sat.add("base")
    if (SITE_TE / ".tw-installed").exists():
        sat.add("te-core")
    if not te_in_bundle(manifest) or state["steps"]["te_torch"]["status"] in FINAL:
        sat.add("te")
    return sat


def selected(step: Step) -> str:
    """'' when the step is to run, else why not."""
    only = [s for s in os.environ.get("TW_VERIFY_ONLY", "").split(",") if s]
    skip = [s for s in os.environ.get("TW_VERIFY_SKIP", "").split(",") if s]
    if only and step.name not in only:
        return "not in TW_VERIFY_ONLY"
    if step.name in skip:
        return "in TW_VERIFY_SKIP"
    return ""


def next_step(state, sat: set, remaining: float, te_bundled: bool):
    """The first step, in priority order, that is pending, has its packages and fits in the time
    left; (step or None, [(step, why it waits)])."""
    waiting = []
    for step in STEPS:
        st = state["steps"][step.name]
        if st["status"] in FINAL:
            continue
        if step.name == "te_torch" and not te_bundled:
            st.update(status="skipped", note="Transformer Engine is not in the bundle")
            continue
        why = selected(step)
        if why:
            st.update(status="skipped", note=why)
            continue
        missing = [n for n in step.needs if n not in sat]
        if missing:
            waiting.append((step, "waits for " + ", ".join(missing)))
            continue
        if remaining < step.min_s * SCALE:
            waiting.append((step, f"needs {step.min_s * SCALE:.0f} s, {remaining:.0f} s left"))
            continue
        return step, waiting
    return None, waiting


def simulate(manifest, budget_s: float = 570.0) -> list:
    """What each call should do, from the steps' estimates: prepare.sh prints it.
    [(call number, carried bundle or None, [activity, ...], estimated seconds)]."""
    state = new_state(manifest)
    arrived_calls, installed = set(), set()
    bundles = manifest["calls"]
    base_calls = {p["call"] for i in group_items(manifest, "base") for p in i["parts"]}
    core_calls = {p["call"] for i in group_items(manifest, "te-core", "te-meta")
                  for p in i["parts"]}
    plan, k = [], 0
    while k < len(bundles) + 6:
        k += 1
        carried = bundles[k - 1]["dir"] if k <= len(bundles) else None
        if carried:
            arrived_calls.add(k)
        used, acts = INSTALL_EST_S["call"], []
        if "base" not in installed and base_calls and base_calls <= arrived_calls:
            installed.add("base")
            used += INSTALL_EST_S["base"]
            acts.append("install base")
        if "te-core" not in installed and core_calls and core_calls <= arrived_calls:
            installed.add("te-core")
            used += INSTALL_EST_S["te-core"]
            acts.append("install TE core")
        while True:
            sat = set(installed)
            if not core_calls or state["steps"]["te_torch"]["status"] in FINAL:
                sat.add("te")
            step, _ = next_step(state, sat, budget_s - used - MARGIN_S, bool(core_calls))
            if step is None:
                break
            state["steps"][step.name]["status"] = "pass"
            est = step.est_s * SCALE
            if step.name == "te_torch" and group_items(manifest, "te-torch-so"):
                est = PREBUILT_EST_S * SCALE  # carried prebuilt: copied and checked
            used += est
            acts.append(f"{step.name} (~{est:.0f} s)")
        plan.append((k, carried, acts, used))
        if all(s["status"] in FINAL for s in state["steps"].values()) and k >= len(bundles):
            break
    return plan


# ---------------------------------------------------------------------------------------------
# the steps

def export_te_torch(lib: Path, state) -> None:
    """Send the compiled extension back (xz, in parts of at most 15 MiB) so that a later window
    carries it (.whl/prebuilt/, see docs/gpu.md) instead of compiling it again."""
    sos = sorted(lib.glob("transformer_engine_torch*.so"))
    if not sos or state["te"].get("exported"):
        return
    data = lzma.compress(sos[0].read_bytes(), preset=6)
    name = sos[0].name + ".xz"
    chunks = [data[i:i + OUT_PART_BYTES] for i in range(0, len(data), OUT_PART_BYTES)]
    if len(chunks) > 3:  # with logs.tar.gz (at most 15 MiB), under the 64 MiB that come back
        say(f"{name} is {mib(len(data))}: too large to bring back; not exported")
        return
    out = out_dir()
    for n, chunk in enumerate(chunks, 1):
        (out / (name if len(chunks) == 1 else f"{name}.part{n}of{len(chunks)}")).write_bytes(chunk)
    state["te"]["exported"] = True
    state["te"]["export"] = f"{name} ({mib(len(data))}, {len(chunks)} file(s) in this call's $OUT)"


def te_importable(log: Path, marker: str) -> bool:
    rc, _ = run([PY, "-c", "import transformer_engine.pytorch as te; print('TE', te.__version__)"],
                log, 300, step_env(), marker)
    return rc == 0


def step_te_torch(manifest, state, timeout: float, marker: str) -> tuple:
    """(status, note)"""
    log = LOGS / "te_torch.log"
    lib = SITE_TE / "transformer_engine" / "wheel_lib"
    for item in group_items(manifest, "te-torch-so"):
        if is_ready(item):
            shutil.copyfile(READY / item["name"], lib / item["name"])
            if DRY:
                return "pass", f"prebuilt {item['name']} copied (dry run: import not checked)"
            if te_importable(log, marker + "-prebuilt"):
                state["te"]["torch_ext"] = "prebuilt"
                return "pass", f"prebuilt {item['name']}"
            (lib / item["name"]).unlink()
            say("the carried prebuilt extension does not import: compiling it")
    src = [i for i in group_items(manifest, "te-torch-src") if is_ready(i)]
    if not src:
        return "error", "no prebuilt extension that imports, and no sdist in the bundle"
    top = WORK / "tetorch" / src[0]["name"].removesuffix(".tar.gz")
    if DRY:
        return "pass", f"dry run: would compile {top.name} ({src[0]['name']})"
    if not top.is_dir():  # kept between calls: an interrupted build goes on where it stopped
        top.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(READY / src[0]["name"]) as tar:
            tar.extractall(top.parent)
    arch = gpu_arch()
    env = dict(step_env(), NVTE_CUDA_ARCHS=arch, MAX_JOBS=str(os.cpu_count() or 16),
               NVTE_FRAMEWORK="pytorch")
    start = time.monotonic()
    rc, _ = run([PY, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                 "--no-cache-dir", "--target", str(SITE_TE), "."], log, timeout, env, marker,
                cwd=top)
    if rc is None:
        return "interrupted", f"compiling (sm_{arch}) ran out of time after {time.monotonic() - start:.0f} s"
    # pip --target leaves the extension in the build tree (TE's wheel command renames files)
    built = sorted(top.glob("build/lib.*/transformer_engine/wheel_lib/transformer_engine_torch*.so"))
    if rc != 0 or not built:
        return "fail", f"compiling failed (exit {rc}): see te_torch.log"
    for so in built:
        shutil.copyfile(so, lib / so.name)
    if not te_importable(log, marker + "-check"):
        return "fail", "compiled, but transformer_engine.pytorch does not import: see te_torch.log"
    state["te"]["torch_ext"] = "built"
    export_te_torch(lib, state)
    return "pass", f"compiled for sm_{arch} in {time.monotonic() - start:.0f} s"


def gpu_arch() -> str:
    try:
        cap = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.split()
        return cap[0].replace(".", "") if cap else "90"
    except (OSError, subprocess.SubprocessError):
        return "90"


RESULT_RE = (re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(tests/\S+?\.py::\S+)"),
             re.compile(r"(tests/\S+?\.py::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b"))


def parse_test_log(text: str) -> dict:
    """{node id: outcome} from pytest -v lines (xdist's and the serial form)."""
    found = {}
    for line in text.splitlines():
        m = RESULT_RE[0].search(line)
        if m:
            found[m.group(2).split("@")[0]] = m.group(1).lower()
            continue
        m = RESULT_RE[1].search(line)
        if m:
            found[m.group(1).split("@")[0]] = m.group(2).lower()
    return found


def parse_junit(path: Path) -> dict:
    """{node id: {outcome, seconds, message}}; a module skipped at import is 'tests/x.py'."""
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):
        return {}
    found = {}
    for case in tree.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "").split("@")[0]
        if cls:
            nodeid = cls.replace(".", "/") + ".py::" + name
        else:
            nodeid = name.replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = el.get("message") or ""
                reason = re.search(r"Skipped: (.*)['\"]\)\s*$", el.text or "")
                if tag == "skipped" and reason:  # a module skipped at import: the reason
                    message = reason.group(1)
                message = (message or el.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        found[nodeid] = {"outcome": outcome, "seconds": float(case.get("time") or 0),
                         "message": message}
    return found


def pytest_cmd(state, attempt: int, pytest_timeout: float, extra: list, step: str = "gpu_tests",
               files: tuple = GPU_TEST_FILES, te: bool = True) -> tuple:
    """(command, junit path). Deselects the tests already reported, except those another step
    skipped (the layouts pass skips what needs Transformer Engine; the TE pass runs them)."""
    xml = LOGS / f"{step}.{attempt}.xml"
    cmd = [PY, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider", "-p", "pytest_timeout",
           "-p", "tw_device_groups", f"--timeout={max(60, int(pytest_timeout))}",
           f"--junitxml={xml}", f"--basetemp={WORK / 'pytest' / f'{step}{attempt}'}"]
    workers = int(os.environ.get("TW_XDIST", "4"))
    env = gpu_test_env(te)
    has_xdist = subprocess.run([PY, "-c", "import xdist"], env=env,
                               capture_output=True).returncode == 0
    if workers > 1 and has_xdist:
        cmd += ["-p", "xdist.plugin", "-n", str(workers), "--dist", "loadgroup"]
    if not any(a.startswith("tests/") for a in extra):
        cmd += list(files)
    for nodeid, t in sorted(state["tests"].items()):
        if "::" not in nodeid or t["outcome"] not in ("passed", "failed", "skipped", "error",
                                                      "xfail", "xpass"):
            continue
        if t["outcome"] == "skipped" and t.get("step", step) != step:
            continue
        cmd += ["--deselect", nodeid]
    return cmd + list(extra), xml


def te_usable() -> bool:
    return (SITE_TE / ".tw-installed").exists() and not (WORK / "te-disabled").exists()


def gpu_test_env(te: bool = True) -> dict:
    env = step_env(te=te and te_usable())
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + str(PLUGIN_DIR)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the machine's own pytest plugins stay out
    return env


def step_gpu_tests(step: str, state, timeout: float, marker: str, attempt: int) -> tuple:
    """``gpu_layouts``: tests/test_gpu_layouts.py without Transformer Engine (what needs it
    skips); ``gpu_tests``: every GPU test module with it, the tests that pass skipped again."""
    if step == "gpu_tests" and not te_usable():
        return "skipped", "no Transformer Engine on this machine: its tests would only skip"
    files = TE_FREE_TEST_FILES if step == "gpu_layouts" else GPU_TEST_FILES
    log = LOGS / f"{step}.log"
    start_len = log.stat().st_size if log.exists() else 0
    (WORK / "pytest").mkdir(exist_ok=True)
    te = step != "gpu_layouts"
    cmd, xml = pytest_cmd(state, attempt, timeout - 15, [], step, files, te)
    rc, seconds = run(cmd, log, timeout, gpu_test_env(te), marker)
    text = log.read_text(errors="replace")[start_len:]
    mine = {}
    for nodeid, outcome in parse_test_log(text).items():
        mine[nodeid] = {"seconds": 0.0, "message": "", "outcome": outcome, "step": step}
    for nodeid, found in parse_junit(xml).items():
        mine[nodeid] = dict(found, step=step)
    state["tests"].update(mine)
    if rc is None:
        return "interrupted", f"stopped after {seconds:.0f} s; the next attempt skips the tests reported so far"
    outcomes = [t["outcome"] for t in state["tests"].values() if t.get("step", step) == step]
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    note = ", ".join(f"{n} {o}" for o, n in counts.items()) + f" (pytest exit {rc})"
    if rc not in (0, 1, 5):
        return "error", note + (f": see {step}.log" if text.strip() else "")
    if {"failed", "error"} & set(outcomes):
        return "fail", note
    return ("pass" if "passed" in outcomes else "skipped"), note


def disk_dir() -> Path:
    """A folder on a real disk (not tmpfs) for the checkpoint bench."""
    for base in (Path("/var/tmp"), Path("/tmp"), ROOT):
        try:
            fstype = subprocess.run(["stat", "-f", "-c", "%T", str(base)], capture_output=True,
                                    text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if fstype and fstype not in ("tmpfs", "ramfs"):
            return base / "tw-ckpt"
    return ROOT / ".tw-ckpt"


def step_command(step: Step, state) -> tuple:
    """(command, env, note) of the steps that are one command."""
    if DRY:
        secs = os.environ.get("TW_DRY_STEP_S", "1")
        return (["bash", "-c", f"echo 'dry run: {step.name} stands in for {secs} s'; sleep {secs}"],
                step_env(), "dry run: stand-in")
    if step.name == "checkpoint_speed":
        work = disk_dir()
        df = subprocess.run(["df", "-hT", str(work.parent)], capture_output=True, text=True).stdout
        state["steps"][step.name]["disk"] = df.strip()
        cmd = [PY, "bench/checkpoint_speed.py", "--ranks", "2", "--workdir", str(work),
               "cluster=local_gpu", "cluster.gpus_per_node=1", "cluster.ranks_per_gpu=2",
               *shlex.split(os.environ.get("TW_CKPT_ARGS", ""))]
        return cmd, step_env(), f"workdir {work}"
    if step.name == "probe":
        return [PY, "bench/device/probe_check.py"], step_env(te=False), ""
    if step.name == "data_prep_scaling":
        env = dict(step_env(), DATA_PREP_SCALING_LOG=os.devnull)
        return (["bash", "bench/device/data_prep_scaling.sh",
                 *shlex.split(os.environ.get("TW_DATA_PREP_ARGS", ""))], env, "")
    raise ValueError(step.name)


def run_step(step: Step, manifest, state, timeout: float, full_timeout: float, run_id: str) -> None:
    st = state["steps"][step.name]
    st["attempts"] += 1
    marker = f"{run_id}-{step.name}-{st['attempts']}"
    say(f"{step.name}: start (attempt {st['attempts']}, timeout {timeout:.0f} s)")
    start = time.monotonic()
    if step.name == "te_torch":
        status, note = step_te_torch(manifest, state, timeout, marker)
        if status in ("fail", "error"):  # the tests then run as where TE is not installed
            (WORK / "te-disabled").touch()
            note += "; the tests run without Transformer Engine"
    elif step.name in ("gpu_layouts", "gpu_tests"):
        status, note = step_gpu_tests(step.name, state, timeout, marker, st["attempts"])
    else:
        cmd, env, note = step_command(step, state)
        rc, _ = run(cmd, LOGS / f"{step.name}.log", timeout, env, marker)
        status = "interrupted" if rc is None else ("pass" if rc == 0 else "fail")
        note = note or ("" if rc in (0, None) else f"exit {rc}: see {step.name}.log")
    seconds = time.monotonic() - start
    if status == "interrupted" and timeout >= full_timeout and step.name != "te_torch":
        status = "timeout"  # its own limit, not the call's end: a hang is not tried again
        note += f"; its own limit of {full_timeout:.0f} s"
    elif status == "interrupted" and st["attempts"] >= 3:
        status = "timeout"
        note += "; stopped by the call's end three times"
    st.update(status="pending" if status == "interrupted" else status, note=note,
              seconds=st["seconds"] + seconds)
    say(f"{step.name}: {status} after {seconds:.0f} s{': ' + note if note else ''}")


# ---------------------------------------------------------------------------------------------
# versions, summary, outputs

VERSIONS = r'''
import importlib.metadata as md, platform, subprocess
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"
print(f"python          {platform.python_version()} ({platform.platform()})")
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    print(f"nvidia-smi      {smi.stdout.strip() or smi.stderr.strip()}")
except Exception as exc:
    print(f"nvidia-smi      {exc!r}")
try:
    import torch
    print(f"torch           {torch.__version__} (CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})"
          if torch.cuda.is_available() else f"torch           {torch.__version__} (no CUDA device)")
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(f"GPU {i}           {props.name}, {props.total_memory / 2**30:.1f} GiB, "
              f"sm_{props.major}{props.minor}, {props.multi_processor_count} SMs")
except Exception as exc:
    print(f"torch           {exc!r}"[:200])
print(f"megatron-core   {version('megatron-core')}")
print(f"deepspeed       {version('deepspeed')}")
try:
    import transformer_engine
    te = getattr(transformer_engine, "__version__", version("transformer_engine"))
    import transformer_engine.pytorch  # noqa: F401
except Exception as exc:  # not installed, or installed but unusable
    te = "absent" if isinstance(exc, ModuleNotFoundError) and "transformer_engine" == getattr(exc, "name", "") else f"broken ({exc!r})"[:200]
print(f"TE              {te}")
print(f"hydra-core      {version('hydra-core')}, omegaconf {version('omegaconf')}, "
      f"pydantic {version('pydantic')}, numpy {version('numpy')}")
print(f"pytest          {version('pytest')}, pytest-timeout {version('pytest-timeout')}, "
      f"pytest-xdist {version('pytest-xdist')}")
print(f"data_prep       gigatoken {version('gigatoken')}, tiktoken {version('tiktoken')}, "
      f"awkward {version('awkward')}")
'''


def record_versions(state) -> None:
    te = (SITE_TE / ".tw-installed").exists() and not (WORK / "te-disabled").exists()
    try:
        proc = subprocess.run([PY, "-c", VERSIONS], env=step_env(te=te), cwd=ROOT, text=True,
                              capture_output=True, timeout=240)
        text = proc.stdout + (proc.stderr[-2000:] if proc.returncode else "")
    except subprocess.TimeoutExpired:
        text = "the version report did not finish in 240 s"
    state["versions"] = f"{text.rstrip()}\ncores           {os.cpu_count()}\n(read {now()})"


def next_call(manifest, state) -> tuple:
    """(complete?, advice)."""
    pending = [s for s in STEPS if state["steps"][s.name]["status"] not in FINAL]
    if manifest is None:
        return False, ("nothing to work with: no bundle has arrived on this machine. Carry "
                       "`.whl/call1` (and `.whl/resume` holding the last $OUT/state.json, if an "
                       "earlier machine got that far), command `bash bench/device/verify.sh`.")
    if not pending:
        return True, "none: every step is done"
    needed = set()
    for step in pending:
        if "base" in step.needs and not (SITE / ".tw-installed").exists():
            needed.add("base")
        if {"te-core", "te"} & set(step.needs) and te_in_bundle(manifest) and \
                state["steps"]["te_torch"]["status"] not in FINAL:
            if not (SITE_TE / ".tw-installed").exists():
                needed |= {"te-core", "te-meta"}
            needed |= {"te-torch-src", "te-torch-so"}
    calls = sorted({p["call"] for item in group_items(manifest, *needed) if not is_ready(item)
                    for p in item["parts"] if not (STASH / p["file"]).exists()})
    if calls:
        rest = f" (then {', '.join(f'.whl/call{c}' for c in calls[1:])}, one a call)" \
            if len(calls) > 1 else ""
        return False, (f"carry `.whl/call{calls[0]}`{rest}, command `bash bench/device/verify.sh`,"
                       " timeout_s 600")
    return False, ("no carry, command `bash bench/device/verify.sh`, timeout_s 600 (pending: "
                   + ", ".join(s.name for s in pending) + ")")


def write_outputs(manifest, state, origin: str) -> tuple:
    complete, advice = next_call(manifest, state)
    failed = [s for s in STEPS if state["steps"][s.name]["status"] in ("fail", "timeout", "error")]
    state["complete"], state["next"] = complete, advice
    (WORK / "state.json").write_text(json.dumps(state, indent=1))
    out = out_dir()
    (out / "state.json").write_text(json.dumps(state, indent=1))
    skipped = [s.name for s in STEPS if state["steps"][s.name]["status"] == "skipped"]
    status = ("NOT COMPLETE" if not complete else
              f"COMPLETE, with failures ({', '.join(s.name for s in failed)})" if failed else
              f"COMPLETE, no failure; skipped: {', '.join(skipped)}" if skipped else
              "COMPLETE, every step passed")
    lines = [f"# GPU window: verification summary{' (DRY RUN: no GPU steps ran)' if DRY else ''}",
             "", f"**{status}.** Next call: {advice}", ""]
    if manifest:
        lines += [f"- bundle `{manifest['id']}`: prepared {manifest['created']} from commit "
                  f"`{manifest.get('commit', '?')}`, {len(manifest['calls'])} bundle calls "
                  f"({', '.join(mib(c['bytes']) for c in manifest['calls'])})"]
    lines += [f"- state: {origin}; written {now()}"]
    for c in state["calls"]:
        bits = [c["mode"]] if c.get("mode") else []
        bits += [f"carried {', '.join(c['carried']) or 'nothing'}",
                f"{c.get('seconds', 0):.0f} s", "fresh machine" if c.get("fresh") else "warm"]
        if c.get("installed"):
            bits.append("installed " + "; ".join(c["installed"]))
        if c.get("ran"):
            bits.append("ran " + ", ".join(c["ran"]))
        if c.get("stopped"):
            bits.append(c["stopped"])
        lines.append(f"- verify run {c['n']} ({c['started']}): " + "; ".join(bits))
        lines += [f"  - problem: {p}" for p in c.get("problems", [])]
    lines += ["", "## Versions", "", "```text", state.get("versions") or "(not read yet)", "```",
              "", "## Steps", "", "| step | status | attempts | seconds | note |",
              "|---|---|---|---|---|"]
    for s in STEPS:
        st = state["steps"][s.name]
        lines.append(f"| {s.name} | {st['status']} | {st['attempts']} | {st['seconds']:.0f} | "
                     f"{st['note'].replace('|', '/')} |")
    tests = state["tests"]
    if tests:
        outcomes = [t["outcome"] for t in tests.values()]
        lines += ["", "## GPU tests", "", ", ".join(f"{outcomes.count(o)} {o}" for o in
                                                    sorted(set(outcomes))), "",
                  "| test | outcome | seconds | message |", "|---|---|---|---|"]
        for nodeid, t in sorted(tests.items()):
            lines.append(f"| {nodeid} | {t['outcome']} | {t.get('seconds', 0):.1f} | "
                         f"{t.get('message', '').replace('|', '/')} |")
    for name, title in (("probe", "The probe and the plan against runs"),
                        ("checkpoint_speed", "Checkpoint save/load against the disk"),
                        ("data_prep_scaling", "data_prep scaling")):
        log = LOGS / f"{name}.log"
        if log.exists():
            text = log.read_text(errors="replace").splitlines()
            lines += ["", f"## {title} ({name}.log{', last 120 lines' if len(text) > 120 else ''})",
                      ""]
            if state["steps"][name].get("disk"):
                lines += ["```text", state["steps"][name]["disk"], "```", ""]
            lines += ["```text", *text[-120:], "```"]
    if state["te"].get("export"):
        lines += ["", "## Transformer Engine's compiled extension",
                  "", f"Came back as {state['te']['export']}: see docs/gpu.md (a later window "
                  "carries it instead of compiling)."]
    if manifest:
        lines += ["", "## Bundle items on this machine", "", "| item | group | MiB | state |",
                  "|---|---|---|---|"]
        for item in manifest["items"]:
            have = sum((STASH / p["file"]).exists() for p in item["parts"])
            where = "ready" if is_ready(item) else f"{have}/{len(item['parts'])} parts " \
                f"(calls {item_calls(item)})"
            lines.append(f"| {item['name']} | {item['group']} | {item['bytes'] / 2**20:.1f} | "
                         f"{where} |")
    lines += ["", "Full logs: `$OUT/logs.tar.gz` (install, te_torch, gpu_tests with the junit "
              "XML, each training run's log, checkpoint_speed, data_prep_scaling, verify)."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    pack_logs(out)
    return complete, bool(failed), advice


def pack_logs(out: Path) -> None:
    tmp = out / "logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(LOGS, arcname="logs")
        runs = WORK / "pytest"
        if runs.is_dir():
            for log in sorted(runs.rglob("*.log")):
                tar.add(log, arcname=f"pytest/{log.relative_to(runs)}")
    if tmp.stat().st_size > OUT_PART_BYTES:  # the training runs' logs are what can be left out
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(LOGS, arcname="logs")
    tmp.rename(out / "logs.tar.gz")


# ---------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install-only", action="store_true",
                        help="stash, join and install what arrived (and TE's extension), no steps")
    parser.add_argument("--pytest", nargs=argparse.REMAINDER,
                        help="install, then run the GPU test pass with these extra pytest "
                             "arguments (no state; for bench/device/run_gpu_tests.sh)")
    args = parser.parse_args()
    start = time.monotonic()
    deadline = start + float(os.environ.get("TW_CALL_BUDGET_S", "570"))
    for d in (STASH, READY, LOGS):
        d.mkdir(parents=True, exist_ok=True)
    fresh = not (WORK / "state.json").exists()
    manifests = carried_manifests()
    if len({m["id"] for m in manifests}) > 1:
        say("the carried bundles come from different prepare.sh runs: "
            + ", ".join(sorted({m["id"] for m in manifests})))
        return 1
    manifest = manifests[0] if manifests else load_json(WORK / "manifest.json")
    state, origin = load_state(manifest)
    if manifests:
        (WORK / "manifest.json").write_text(json.dumps(manifest))
    run_id = RUN_ID
    if manifest:
        state["bundle"] = manifest["id"]
    call = {"n": len(state["calls"]) + 1, "started": now(), "fresh": fresh,
            "carried": carried_calls(), "stashed": [], "assembled": [], "installed": [],
            "problems": [], "ran": [],
            "mode": "install only" if args.install_only else "pytest" if args.pytest is not None
            else ""}
    state["calls"].append(call)
    say(f"verify run {call['n']} ({'fresh machine' if fresh else 'warm machine'}, state: "
        f"{origin}); carried: {', '.join(call['carried']) or 'nothing'}")
    stale = kill_marked("", exact=False)
    if stale:
        call["problems"].append(f"killed {stale} process(es) left running by an earlier run "
                                "(stopped from outside, past the call's limit?)")
    if manifest:
        stash(manifest, call)
        assemble(manifest, call)
        install(manifest, state, call)
        for p in call["problems"]:
            say(f"problem: {p}")
    if (SITE / ".tw-installed").exists() and (fresh or call["installed"] or not state["versions"]):
        record_versions(state)

    if args.pytest is not None or args.install_only:
        te_step = state["steps"]["te_torch"]
        if manifest and "te-core" in satisfied(manifest, state) and te_step["status"] not in FINAL:
            run_step(STEP["te_torch"], manifest, state, 540, 540, run_id)
        write_outputs(manifest, state, origin)
        if args.install_only:
            return 0 if (SITE / ".tw-installed").exists() else 1
        (WORK / "pytest").mkdir(exist_ok=True)
        cmd, _ = pytest_cmd(new_state(manifest), 0, 900, args.pytest)
        log = out_dir() / "gpu_tests.log"
        say(f"pytest, output also in {log}")
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=gpu_test_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
        return proc.wait()

    while manifest:
        remaining = deadline - time.monotonic() - MARGIN_S
        step, waiting = next_step(state, satisfied(manifest, state), remaining,
                                  te_in_bundle(manifest))
        if step is None:
            if waiting:
                call["stopped"] = "left for a later call: " + "; ".join(
                    f"{s.name} ({why})" for s, why in waiting)
            break
        full = step.timeout_s * SCALE
        run_step(step, manifest, state, min(full, remaining), full, run_id)
        call["ran"].append(f"{step.name} {state['steps'][step.name]['status']}")
        if step.name == "te_torch":
            record_versions(state)
        call["seconds"] = time.monotonic() - start
        write_outputs(manifest, state, origin)
    call["seconds"] = time.monotonic() - start
    complete, failed, advice = write_outputs(manifest, state, origin)
    say(f"done in {call['seconds']:.0f} s; {'complete' if complete else 'not complete'}"
        f"{', with failures' if failed else ''}. Next call: {advice}")
    say(f"summary: {out_dir() / 'summary.md'}")
    if manifest is None:
        return 1
    if not complete:
        return 10
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
