"""The host side of a GPU window: ``bash bench/device/prepare.sh`` runs this file.

Run it on a machine with a package index (pip reaches PyPI), in the checkout the device calls
are made from. It downloads every package the GPU tests and benches need on the device machine
(CPython 3.12, manylinux x86-64; torch 2.11.0+cu130 and the rest of
bench/device/device-packages.txt are already there): the pinned lists
bench/device/gpu-wheels.txt and bench/device/data_prep-wheels.txt, one file per project (two
versions of one project stop the run), wheels built here for the pure-Python projects PyPI has
as source only, and Transformer Engine's PyTorch extension as its source archive (compiled on
the device), or compiled on an earlier device (``.whl/prebuilt/``, see docs/gpu.md). It checks
that every requirement of every carried package is carried or on the device, compresses the
large wheels (xz of a stored zip: Transformer Engine's 186 MB core travels as about 125 MB),
splits what does not fit into one device call, and lays out the carry bundles ``.whl/call1/`` ...
``.whl/callN/``, each under the device tool's 64 MiB a call less the working tree that travels
with it, with ``manifest.json`` (sha256 and size of every file, part and joined item) in each.
Downloads are kept in ``.whl/cache/`` (a second run downloads and compresses nothing again).

It prints how many device calls it takes and each call's carry and command (also in
``.whl/plan.txt``). Exit status 1, with the packages and the reasons, when a download fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from files import sha256  # bench/device/files.py (this script's folder is on sys.path)

from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import (canonicalize_name, parse_sdist_filename,
                                         parse_wheel_filename)
from pip._vendor.packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verify  # noqa: E402  (the device side: its steps, for the plan's estimate)

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "bench" / "device"
WHL = ROOT / ".whl"
CACHE = WHL / "cache"
LISTS = (HERE / "gpu-wheels.txt", HERE / "data_prep-wheels.txt")
DEVICE_LIST = HERE / "device-packages.txt"
TARGET = {"python": "3.12", "full": "3.12.3"}
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in range(35, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])
"""The device's glibc is at least 2.35 (Ubuntu's Python 3.12.3); pip matches each N exactly."""
LIMIT = 64 << 20
"""The device tool's limit on what travels in one call: the working tree plus the carry."""
MANIFEST_RESERVE = 64 << 10
SPLIT_MIN = 8 << 20
"""Files smaller than this are never split (they start a new call when they do not fit)."""
XZ_MIN = 4 << 20
"""Wheels of at least this size travel as xz of a stored zip when that saves 10%."""
GROUP_ORDER = ("base", "te-meta", "te-torch-src", "te-torch-so", "te-core")
GROUPS = {"transformer-engine": "te-meta", "transformer-engine-cu13": "te-core",
          "transformer-engine-torch": "te-torch-src"}
DEVICE_KEEPS = {
    "numpy": "the device's numpy is the one its torch and jax were built against; a carried one "
             "would shadow it (data_prep runs on it too)",
}
NOT_CARRIED = {
    "torch": "on the device (2.11.0+cu130, the version of docs/gpu.md's measurements)",
    "wandb": "imported only with logger=wandb, which no GPU test or bench uses",
    "py-spy": "a binary the hang watchdog runs only when a rank hangs (its dump is then skipped)",
    "kubernetes-validate": "imported only to check Kubernetes manifests, which no GPU step writes",
    "kubeflow-trainer-api": "imported only to check Kubernetes manifests, as above",
    "cel-python": "imported only to evaluate the Kubeflow CRDs' rules, as above",
}
"""The project's runtime dependencies (pyproject.toml) that travel neither ways."""
IGNORED_REQUIREMENTS = {
    ("transformer-engine-torch", "transformer-engine-cu12"):
        "the sdist's metadata names the CUDA 12 core; the CUDA 13 core is carried",
}


def log(msg: str = "") -> None:
    print(msg, flush=True)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class Failure(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# what to carry

def read_lists() -> dict:
    """{canonical name: {name, version, mode, list}}; mode: wheel | build | sdist."""
    reqs, problems = {}, []
    for path in LISTS:
        for raw in path.read_text().splitlines():
            line, _, comment = raw.partition("#")
            line = line.strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
            if not m:
                problems.append(f"{path.name}: '{line}' is not NAME==VERSION")
                continue
            name, version = canonicalize_name(m.group(1)), m.group(2)
            mode = ("build" if "sdist: build here" in comment else
                    "sdist" if "sdist: carry" in comment else "wheel")
            old = reqs.get(name)
            if old and Version(old["version"]) != Version(version):
                problems.append(f"{name} is pinned twice: {old['version']} ({old['list']}) and "
                                f"{version} ({path.name}); two versions stop the install")
                continue
            if old:
                continue
            reqs[name] = {"name": name, "pin": m.group(1), "version": version, "mode": mode,
                          "list": path.name}
    if problems:
        raise Failure("\n".join(problems))
    return reqs


def read_device() -> dict:
    out = {}
    for raw in DEVICE_LIST.read_text().splitlines():
        line = raw.partition("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


# ---------------------------------------------------------------------------------------------
# downloads

def pip_reason(stderr: str, stdout: str = "") -> str:
    lines = [ln.strip() for ln in stderr.splitlines()
             if ln.strip() and not ln.startswith("WARNING: Location")]
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]
    text = " ".join(errors)[:400]
    fetch = re.search(r"Could not fetch URL (\S+): (.*)", stdout + "\n" + stderr)
    if fetch or re.search(r"NewConnectionError|Temporary failure in name resolution|"
                          r"Max retries|ProxyError|Network is unreachable", stderr):
        where = f"{fetch.group(1)}: {fetch.group(2)[:300]}" if fetch else text
        return f"the package index is not reachable from here ({where})"
    if "No matching distribution" in stderr or "Could not find a version" in stderr:
        return ("the index has no wheel of it for CPython 3.12 on manylinux x86-64 "
                f"(glibc <= 2.35) (pip: {text})")
    return f"pip: {text}"


def pip_download(reqs: list, dest: Path, verbose: bool = False) -> dict:
    """Downloads wheels for the device's Python; {requirement: why it failed}."""
    if not reqs:
        return {}
    # -vv: only then does pip say that it could not reach the index (else: "from versions: none")
    cmd = [sys.executable, "-m", "pip", "download", *(["-vv"] if verbose else []),
           "--no-deps", "--only-binary=:all:",
           "--implementation", "cp", "--python-version", TARGET["python"],
           "--progress-bar", "off", "--disable-pip-version-check", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    proc = subprocess.run(cmd + reqs, capture_output=True, text=True)
    if proc.returncode == 0:
        return {}
    if len(reqs) == 1 and verbose:
        return {reqs[0]: pip_reason(proc.stderr, proc.stdout)}
    failed = {}
    for r in reqs:  # which of them failed, and why
        failed.update(pip_download([r], dest, verbose=True))
    return failed or {"(batch)": pip_reason(proc.stderr)}


def pip_build(req: str, dest: Path) -> str:
    """Builds the wheel of a pure-Python sdist here; '' or why it failed."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--disable-pip-version-check", "-w", str(dest), req],
                          capture_output=True, text=True)
    return "" if proc.returncode == 0 else pip_reason(proc.stderr)


def fetch_sdist(name: str, version: str, dest: Path) -> str:
    """The source archive of name==version from PyPI's simple index (pip download would build
    its metadata, which for Transformer Engine's PyTorch extension needs torch and CUDA here);
    '' or why it failed."""
    url = f"https://pypi.org/simple/{name}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"PyPI's simple index is not reachable from here ({url}: {exc})"
    for f in files:
        if not f["filename"].endswith(".tar.gz"):
            continue
        try:
            n, v = parse_sdist_filename(f["filename"])
        except Exception:
            continue
        if n == name and v == Version(version):
            tmp = dest / (f["filename"] + ".tmp")
            try:
                with urllib.request.urlopen(f["url"], timeout=300) as r, open(tmp, "wb") as out:
                    shutil.copyfileobj(r, out)
            except (urllib.error.URLError, OSError) as exc:
                return f"the file host is not reachable from here ({f['url']}: {exc})"
            if sha256(tmp) != f["hashes"].get("sha256"):
                tmp.unlink()
                return f"{f['filename']}: sha256 differs from the index's"
            tmp.rename(dest / f["filename"])
            return ""
    return f"PyPI has no source archive of {name} {version}"


def find(name: str, version: str, folder: Path, sdist: bool = False):
    for path in sorted(folder.glob("*.tar.gz" if sdist else "*.whl")):
        try:
            n, v = (parse_sdist_filename(path.name) if sdist
                    else parse_wheel_filename(path.name)[:2])
        except Exception:
            continue
        if n == name and v == Version(version):
            return path
    return None


def download(reqs: dict) -> dict:
    """{canonical name: downloaded file}; raises Failure naming every package that failed."""
    dl, built = CACHE / "dl", CACHE / "built"
    dl.mkdir(parents=True, exist_ok=True)
    built.mkdir(parents=True, exist_ok=True)
    carried = {n: r for n, r in reqs.items() if n not in DEVICE_KEEPS}
    wheels = [f"{r['pin']}=={r['version']}" for r in carried.values() if r["mode"] == "wheel"
              and not find(r["name"], r["version"], dl)]
    log(f"downloading {len(wheels)} wheels for CPython {TARGET['python']} manylinux x86-64 "
        f"({len(carried) - len(wheels) - sum(r['mode'] != 'wheel' for r in carried.values())} "
        "already in .whl/cache) ...")
    failed = pip_download(wheels, dl)
    for r in carried.values():
        spec = f"{r['pin']}=={r['version']}"
        if r["mode"] == "build" and not find(r["name"], r["version"], built):
            log(f"building {spec} here (PyPI has its source only) ...")
            why = pip_build(spec, built)
            if why:
                failed[spec] = f"could not build its wheel here: {why}"
        elif r["mode"] == "sdist" and not find(r["name"], r["version"], dl, sdist=True):
            log(f"fetching the source archive of {spec} ...")
            why = fetch_sdist(r["name"], r["version"], dl)
            if why:
                failed[spec] = why
    files = {}
    for r in carried.values():
        spec = f"{r['pin']}=={r['version']}"
        if spec in failed:
            continue
        path = find(r["name"], r["version"], {"wheel": dl, "build": built, "sdist": dl}[r["mode"]],
                    sdist=r["mode"] == "sdist")
        if path is None:
            failed[spec] = "pip reported success but left no matching file"
            continue
        if r["mode"] == "build":
            tags = parse_wheel_filename(path.name)[3]
            if not all(t.abi == "none" and t.platform == "any" for t in tags):
                failed[spec] = (f"the wheel built here ({path.name}) is not pure Python, so it "
                                "would not run on the device's CPython 3.12")
                continue
        files[r["name"]] = path
    if failed:
        raise Failure("these packages could not be obtained, so the device would miss them:\n"
                      + "\n".join(f"  - {k}: {v}" for k, v in failed.items()))
    return files


# ---------------------------------------------------------------------------------------------
# the carried packages' own requirements

def metadata_of(path: Path) -> str:
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return z.read(name).decode("utf-8", "replace")
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if m.name.count("/") == 1
                      and m.name.endswith("/PKG-INFO"))
        return tar.extractfile(member).read().decode("utf-8", "replace")


def check_requirements(files: dict, reqs: dict, device: dict) -> list:
    """Problems: a requirement that is neither carried nor on the device, or carried in a
    version it excludes. Also the project's own runtime dependencies (pyproject.toml)."""
    env = dict(default_environment(), python_version=TARGET["python"],
               python_full_version=TARGET["full"], sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython", os_name="posix", extra="")
    versions = {n: reqs[n]["version"] for n in files}
    problems = []

    def check(parent: str, text: str) -> None:
        try:
            req = Requirement(text)
        except Exception:
            return
        if req.marker and not req.marker.evaluate(env):
            return
        dep = canonicalize_name(req.name)
        if (parent, dep) in IGNORED_REQUIREMENTS:
            return
        if dep in versions:
            if not req.specifier.contains(versions[dep], prereleases=True):
                problems.append(f"{parent} needs {text}; {dep} {versions[dep]} is carried")
        elif dep in device or dep in DEVICE_KEEPS:
            have = device.get(dep)
            if have and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{parent} needs {text}; the device has {dep} {have}")
        elif dep not in NOT_CARRIED:
            problems.append(f"{parent} needs {text}: neither carried nor on the device")

    for name, path in files.items():
        for line in metadata_of(path).splitlines():
            if line.startswith("Requires-Dist:"):
                check(name, line.split(":", 1)[1].strip())
    try:
        import tomllib
        deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    except Exception as exc:  # Python < 3.11, or no pyproject
        deps = []
        log(f"(pyproject.toml's dependencies not checked: {exc!r})")
    for text in deps:
        dep = canonicalize_name(Requirement(text).name)
        if dep in NOT_CARRIED:
            continue
        check("trainwright (pyproject.toml)", text)
    return problems


# ---------------------------------------------------------------------------------------------
# compression, items

def xz(decoded: Path, encoded: Path) -> None:
    tmp = encoded.with_suffix(".tmp")
    if shutil.which("xz"):
        with open(tmp, "wb") as out:
            subprocess.run(["xz", "-9e", "-T0", "-c", str(decoded)], stdout=out, check=True)
    else:
        with open(decoded, "rb") as f, lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as out:
            shutil.copyfileobj(f, out, 8 << 20)
    tmp.rename(encoded)


def stored_zip(src: Path, dest: Path) -> None:
    """The same wheel with every member stored (uncompressed), so that xz sees the bytes."""
    tmp = dest.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            new.external_attr, new.create_system = info.external_attr, info.create_system
            with zin.open(info) as f, zout.open(new, "w", force_zip64=info.file_size > 2**31) as out:
                shutil.copyfileobj(f, out, 8 << 20)
    tmp.rename(dest)


def encode(path: Path, wheel: bool) -> dict:
    """The form a file travels in: plain, or xz (of a stored zip for a wheel) where that saves
    10%. Cached by the file's sha256."""
    digest = sha256(path)
    item = {"name": path.name, "bytes": path.stat().st_size, "sha256": digest,
            "encoding": "plain", "encoded": path.name, "encoded_bytes": path.stat().st_size,
            "encoded_sha256": digest, "source": str(path)}
    if path.stat().st_size < XZ_MIN:
        return item
    folder = CACHE / "xz" / digest[:16]
    done = folder / "done.json"
    if not done.exists():
        folder.mkdir(parents=True, exist_ok=True)
        log(f"compressing {path.name} ({mb(path.stat().st_size)}) with xz -9e: once, cached in "
            f"{folder.relative_to(ROOT)} (minutes for a large one) ...")
        decoded = folder / path.name
        if wheel:
            stored_zip(path, decoded)
        else:
            shutil.copyfile(path, decoded)
        encoded = folder / (path.name + ".xz")
        xz(decoded, encoded)
        done.write_text(json.dumps({"bytes": decoded.stat().st_size, "sha256": sha256(decoded),
                                    "encoded_bytes": encoded.stat().st_size,
                                    "encoded_sha256": sha256(encoded)}))
        decoded.unlink()  # the device makes it again from the .xz; its sha256 is recorded
    meta = json.loads(done.read_text())
    if meta["encoded_bytes"] > 0.9 * path.stat().st_size:
        return item
    item.update(bytes=meta["bytes"], sha256=meta["sha256"], encoding="xz",
                encoded=path.name + ".xz", encoded_bytes=meta["encoded_bytes"],
                encoded_sha256=meta["encoded_sha256"], source=str(folder / (path.name + ".xz")),
                original={"bytes": path.stat().st_size, "sha256": digest})
    return item


def prebuilt_so(arg: str):
    """Transformer Engine's PyTorch extension compiled on an earlier device (its $OUT): a .so, a
    .so.xz, or parts NAME.so.xz.partKofN (joined here); from --te-torch-so or .whl/prebuilt/."""
    folder = WHL / "prebuilt"
    if arg:
        path = Path(arg).resolve()
    else:
        found = sorted(folder.glob("transformer_engine_torch*.so*")) if folder.is_dir() else []
        if not found:
            return None
        path = found[0]
    m = re.fullmatch(r"(.+\.so\.xz)\.part\d+of(\d+)", path.name)
    if m:
        parts = sorted(path.parent.glob(m.group(1) + ".part*of" + m.group(2)),
                       key=lambda p: int(re.search(r"part(\d+)of", p.name).group(1)))
        if len(parts) != int(m.group(2)):
            raise Failure(f"{path.parent}: {len(parts)} of the {m.group(2)} parts of {m.group(1)}")
        folder.mkdir(parents=True, exist_ok=True)
        joined = folder / m.group(1)
        with open(joined, "wb") as out:
            for p in parts:
                out.write(p.read_bytes())
        path = joined
    if path.name.endswith(".xz"):
        folder.mkdir(parents=True, exist_ok=True)
        so = folder / path.name[:-3]
        with lzma.open(path) as f, open(so, "wb") as out:
            shutil.copyfileobj(f, out)
        path = so
    if not path.name.endswith(".so"):
        raise Failure(f"{path}: not a transformer_engine_torch*.so (.xz, .partKofN)")
    return path


# ---------------------------------------------------------------------------------------------
# bundles

def tree_bytes() -> tuple:
    """Bytes of what travels besides the carry: tracked and untracked-not-ignored files, and an
    ignored shared/ (it travels too); (bytes, the five largest untracked files)."""
    def listed(*args) -> list:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", *args],
                             capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]

    files = set(listed("--cached", "--others", "--exclude-standard"))
    if (ROOT / "shared").is_dir():
        files |= set(listed("--others", "--ignored", "--exclude-standard", "shared"))
    total, untracked = 0, []
    tracked = set(listed("--cached"))
    for rel in files:
        p = ROOT / rel
        if p.is_file() and not p.is_symlink():
            size = p.stat().st_size
            total += size
            if rel not in tracked:
                untracked.append((size, rel))
    return total, sorted(untracked, reverse=True)[:5]


def pack(items: list, budget: int) -> list:
    """Fills calls in order; splits files of SPLIT_MIN or more to fill each call. The base group
    ends its call: a window of 15 minutes carries the base alone first (the layouts, the probe,
    checkpoints and data_prep need nothing else) and leaves Transformer Engine to later calls.
    Adds 'parts' to every item: [{file, call, offset, bytes}]."""
    calls, room = 1, budget
    for k, item in enumerate(items):
        size, parts = item["encoded_bytes"], []
        if k and items[k - 1]["group"] == "base" != item["group"] and room < budget:
            calls, room = calls + 1, budget
        if size > room and (size < SPLIT_MIN or room < (1 << 20)):
            calls, room = calls + 1, budget
        if size <= room:
            parts.append({"call": calls, "offset": 0, "bytes": size})
            room -= size
        else:
            offset = 0
            while offset < size:
                n = min(room, size - offset)
                parts.append({"call": calls, "offset": offset, "bytes": n})
                offset += n
                room -= n
                if offset < size:
                    calls, room = calls + 1, budget
        for k, part in enumerate(parts, 1):
            part["file"] = item["encoded"] if len(parts) == 1 else \
                f"{item['encoded']}.part{k}of{len(parts)}"
        item["parts"] = parts
    return [c for c in range(1, calls + 1)]


def write_bundles(items: list, calls: list) -> None:
    for old in WHL.glob("call*"):
        if re.fullmatch(r"call\d+", old.name) and old.is_dir():
            shutil.rmtree(old)
    for c in calls:
        (WHL / f"call{c}").mkdir(parents=True)
    for item in items:
        src = Path(item["source"])
        for part in item["parts"]:
            dest = WHL / f"call{part['call']}" / part["file"]
            if len(item["parts"]) == 1:
                try:
                    os.link(src, dest)
                except OSError:
                    shutil.copyfile(src, dest)
                part["sha256"] = item["encoded_sha256"]
                continue
            h = hashlib.sha256()
            with open(src, "rb") as f, open(dest, "wb") as out:
                f.seek(part["offset"])
                left = part["bytes"]
                while left:
                    block = f.read(min(left, 8 << 20))
                    h.update(block)
                    out.write(block)
                    left -= len(block)
            part["sha256"] = h.hexdigest()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# ---------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--te-torch-so", default="",
                        help="Transformer Engine's compiled PyTorch extension from an earlier "
                             "device ($OUT of its verify.sh): .so, .so.xz or .so.xz.partKofN "
                             "(default: .whl/prebuilt/transformer_engine_torch*)")
    parser.add_argument("--margin-mib", type=float, default=2.0,
                        help="room left in each call for the working tree to grow (2)")
    parser.add_argument("--limit-mib", type=float, default=64.0,
                        help="the device tool's limit on one call's transfer (64)")
    args = parser.parse_args()

    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ".whl/call1/x"])
    if ignored.returncode != 0:
        raise Failure(".whl/ is not ignored by git here, so all of it would travel in every "
                      "call: add '/.whl/' to .gitignore")
    reqs, device = read_lists(), read_device()
    files = download(reqs)
    problems = check_requirements(files, reqs, device)
    if problems:
        raise Failure("the carried packages would not import on the device:\n"
                      + "\n".join(f"  - {p}" for p in problems))
    items = []
    for name, path in files.items():
        item = encode(path, wheel=path.suffix == ".whl")
        item["group"] = GROUPS.get(name, "base")
        item["project"] = f"{name}=={reqs[name]['version']}"
        items.append(item)
    so = prebuilt_so(args.te_torch_so)
    if so:
        item = encode(so, wheel=False)
        item.update(group="te-torch-so", project="transformer_engine_torch (prebuilt)")
        items.append(item)
    items.sort(key=lambda i: (GROUP_ORDER.index(i["group"]), i["name"]))

    limit = int(args.limit_mib * 2**20)
    tree, untracked = tree_bytes()
    budget = limit - tree - int(args.margin_mib * 2**20) - MANIFEST_RESERVE
    if budget < SPLIT_MIN:
        raise Failure(f"the working tree takes {mib(tree)} of the {mib(limit)} a call carries: "
                      f"too little room for bundles. Largest untracked files: {untracked}")
    calls = pack(items, budget)
    write_bundles(items, calls)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    ident = hashlib.sha256(json.dumps([[i["sha256"], [p["sha256"] for p in i["parts"]]]
                                       for i in items]).encode()).hexdigest()[:12]
    manifest = {
        "format": 1, "id": ident, "commit": commit + ("+changes" if dirty else ""),
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "target": f"CPython {TARGET['python']}, manylinux x86-64",
        "limit_bytes": limit, "tree_bytes": tree, "budget_bytes": budget,
        "items": [{k: v for k, v in i.items() if k != "source"} for i in items],
        "calls": [],
    }
    for c in calls:
        manifest["calls"].append({"n": c, "dir": f".whl/call{c}", "bytes": 0})
    text = json.dumps(manifest, indent=1)
    for c in calls:
        (WHL / f"call{c}" / "manifest.json").write_text(text)
    for entry in manifest["calls"]:
        entry["bytes"] = dir_bytes(ROOT / entry["dir"])
    text = json.dumps(manifest, indent=1)  # with the sizes; same length give or take digits
    for c in calls:
        (WHL / f"call{c}" / "manifest.json").write_text(text)
    (WHL / "manifest.json").write_text(text)
    report(manifest, items, reqs, tree, untracked)
    return 0


def report(manifest: dict, items: list, reqs: dict, tree: int, untracked: list) -> None:
    lines = []
    out = lines.append
    total_orig = sum(i.get("original", i)["bytes"] for i in items)
    total_sent = sum(i["encoded_bytes"] for i in items)
    out(f"GPU window bundle {manifest['id']} (commit {manifest['commit']}, {manifest['created']})")
    groups = [i["group"] for i in items]
    counts = ", ".join(f"{g} {groups.count(g)}" for g in GROUP_ORDER if g in groups)
    out(f"packages: {len(items)} files, {mb(total_orig)} downloaded or built ({counts}); "
        f"they travel as {mb(total_sent)} ({mib(total_sent)})")
    for i in items:
        how = (f"xz {mb(i['encoded_bytes'])} of {mb(i['original']['bytes'])}" if
               i["encoding"] == "xz" else mb(i["encoded_bytes"]))
        split = f", {len(i['parts'])} parts" if len(i["parts"]) > 1 else ""
        out(f"  {i['group']:<13} {i['name']:<78} {how}{split}")
    out("not carried: " + "; ".join(f"{k} ({v})" for k, v in {**DEVICE_KEEPS, **NOT_CARRIED}.items()))
    out(f"per call: {mib(manifest['limit_bytes'])} limit - working tree {mib(tree)} "
        f"- margin - manifest = bundle limit {mib(manifest['budget_bytes'])}")
    if untracked:
        out("  (untracked files in the working tree travel too; largest: "
            + ", ".join(f"{rel} {mib(s)}" for s, rel in untracked) + ")")
    plan = verify.simulate(manifest)
    bundles = len(manifest["calls"])
    est = 90 + sum(used + 15 for _, _, _, used in plan) + 30 * (len(plan) - 1)
    out("")
    out(f"DEVICE CALLS: {len(plan)} ({bundles} carrying bundles, then "
        f"{len(plan) - bundles} with no carry; estimated device time {est / 60:.0f} min of "
        "the session's 15, counting the machine's start and 30 s between calls)")
    out("Make them back to back: the machine is given back after 30 s idle and the stash with it.")
    out("Short of device time (status's budget_left_s under the estimate)? Run the commands as "
        "`TW_VERIFY_SKIP=data_prep_scaling bash bench/device/verify.sh` (about 6 min less).")
    for k, carried, acts, used in plan:
        entry = manifest["calls"][k - 1] if carried else None
        carry = f'["{carried}"]' if carried else "[] (none)"
        size = (f"   {mib(entry['bytes'])} + tree {mib(tree)} = "
                f"{mib(entry['bytes'] + tree)} of {mib(manifest['limit_bytes'])}") if entry else ""
        content = ""
        if entry:
            names = [p["file"] for i in items for p in i["parts"] if p["call"] == k]
            content = f"; holds {len(names)} files"
            big = [p["file"] for i in items for p in i["parts"] if p["call"] == k
                   and len(i["parts"]) > 1]
            if big:
                content += f" ({', '.join(big)})"
        out(f"  call {k}: carry {carry}, command: bash bench/device/verify.sh, timeout_s 600{size}")
        out(f"          expected: {', '.join(acts) or 'stash only'} (~{used:.0f} s){content}")
    out("Each call's $OUT/summary.md names the next call; when it says COMPLETE, the window is "
        "done. If a call lands on a fresh machine (the summary says so), copy that call's "
        "$OUT/state.json to .whl/resume/state.json and add \".whl/resume\" to the next calls' "
        "carry: the summary then says which bundles to send again.")
    text = "\n".join(lines)
    (WHL / "plan.txt").write_text(text + "\n")
    log("")
    log(text)
    log(f"\n(also in .whl/plan.txt; manifest .whl/manifest.json)")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as exc:
        print(f"\nprepare.sh FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
