"""launcher.engines.compat: every library patch is listed once, for a known library version, and
each still answers a need of the unpatched library.

When Megatron-Core (or torch) is upgraded, ``test_shims_match_the_installed_versions`` fails
until each shim is re-checked against the new version; when a library fixes what a shim works
around, ``test_every_shim_is_still_needed`` fails for that shim, so it can be deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_shims_match_the_installed_versions():
    from launcher.engines.compat import SHIMS

    for shim in SHIMS:
        installed = metadata.version(shim.library).split("+")[0]  # a local build tag: same code
        assert installed == shim.version, (
            f"shim {shim.name!r} was written for {shim.library} {shim.version}; re-check it "
            f"against {metadata.version(shim.library)} and update its version")


@pytest.mark.slow
def test_every_shim_is_still_needed():
    """Probes run in a fresh process, before anything is patched."""
    code = ("import json; from launcher.engines.compat import SHIMS; "
            "print(json.dumps({s.name: bool(s.needed()) for s in SHIMS}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    needed = json.loads(out.stdout.strip().splitlines()[-1])
    assert needed and all(needed.values()), needed


@pytest.mark.slow
def test_install_applies_the_shims_of_this_machine_once():
    """On a CPU machine without Transformer Engine every process-wide shim applies."""
    code = ("import json; from launcher.engines import compat; a = compat.install(); "
            "b = compat.install(); "
            "from megatron.core.transformer.moe import moe_utils; "
            "print(json.dumps([a, b, moe_utils.te_general_gemm is None]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    first, again, router = json.loads(out.stdout.strip().splitlines()[-1])
    from launcher.engines.compat import SHIMS

    assert first == again == [s.name for s in SHIMS if s.apply is not None]
    assert router  # the MoE router shim: without TE te_general_gemm is None, not undefined


@pytest.mark.slow
def test_disable_te_hides_transformer_engine(monkeypatch):
    code = ("import json, os; from launcher.engines import compat; compat.install(); "
            "import importlib.util\n"
            "try:\n    import transformer_engine\n    hidden = False\n"
            "except ImportError as e:\n    hidden = 'TRAINWRIGHT_DISABLE_TE' in str(e)\n"
            "print(json.dumps([hidden, compat.transformer_engine_available()]))")
    env = {"TRAINWRIGHT_DISABLE_TE": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True, env=env)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False]


QUEUE_SERVER_PROBE = """\
import json, os, signal, sys, time
from launcher.engines import compat
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

before = fa._results_queue is None
compat.start_save_results_queue("SIGHUP")  # trainer.stop_signal=SIGHUP
queue = fa._get_write_results_queue()
pid = queue._manager._process.pid
for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR2):
    os.kill(pid, sig)
time.sleep(0.5)
queue.put({0: [WriteResult(index=MetadataIndex("w"), size_in_bytes=3, storage_data=None)]})
result = queue.get()[0][0].size_in_bytes
print(json.dumps([before, pid, open(f"/proc/{pid}/cmdline").read() ==
                  open("/proc/self/cmdline").read(), result, queue.qsize()]), flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_the_save_results_server_is_a_fork_that_outlives_no_stop_and_no_rank():
    """Megatron-Core's save-results queue comes from a server forked from the rank (the same
    command line: no fresh interpreter importing torch on the first save's path); it serves a
    torch write result after the stop signals (the run's trainer.stop_signal among them) sent to
    it as to a whole process group; the rank
    killed with -9, the server is gone within seconds (it would hold the rank's sockets)."""
    rank = subprocess.Popen([sys.executable, "-c", QUEUE_SERVER_PROBE], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        before, server, forked, result, left = json.loads(rank.stdout.readline())
        assert (before, forked, result, left) == (True, True, 3, 0)
        rank.kill()
        rank.wait()
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server)
    finally:
        rank.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped by init shortly, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@contextlib.contextmanager
def held_open(path, create: bool = False):
    """While inside, another process holds ``path`` open (as a FileBaton's builder does;
    ``create``: it creates the file exclusively, as the baton does)."""
    flags = "os.O_CREAT | os.O_EXCL" if create else "os.O_RDONLY"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import os, time\nfd = os.open({str(path)!r}, {flags})\n"
         "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_jit_build_locks_of_killed_ranks_go_and_a_live_builds_lock_stays(tmp_path, monkeypatch):
    """release_jit_build_locks (after the watch kills an attempt): a lock no process holds is
    stale and removed; a lock a live process holds open (a FileBaton of another job building
    the same op in the shared cache) stays. Removing it made that build fail with
    FileNotFoundError in its baton.release() (seen with two jobs on one machine)."""
    import subprocess
    import sys
    import time

    from launcher.core.jit_locks import release_jit_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, live = tmp_path / "op_a" / "lock", tmp_path / "op_b" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir()
    stale.touch()
    with held_open(live, create=True):
        removed = release_jit_build_locks(since=time.time() - 60)
        assert removed == [str(stale)]
        assert live.exists() and not stale.exists()
    assert release_jit_build_locks(since=time.time() - 60) == [str(live)]


def test_an_agent_outlives_the_rendezvous_store_it_polls():
    """The first node's agent hosts the c10d store and may exit (its ranks stopped for requeue)
    before another node's rank has finished the same stop. That agent's poll of the store must
    then answer "no new node", not raise: before the fix it exited 1 and a clean requeue (75)
    read as a crash. A real c10d rendezvous handler, on a store this test hosts and closes."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from launcher.engines.compat import store_loss_tolerant
    from launcher.parallel.distributed import free_port

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id="lost",
                                  min_nodes=2, max_nodes=2, local_addr="127.0.0.2",
                                  read_timeout=2, is_host=False)
    handler = get_rendezvous_handler(params)
    assert handler.num_nodes_waiting() == 0
    del store  # the first node's agent exits
    time.sleep(1.2)  # past the handler's one-second cache of the store's state
    with pytest.raises(RendezvousConnectionError):
        handler.num_nodes_waiting()
    store_loss_tolerant(handler)
    assert handler.num_nodes_waiting() == 0
    store_loss_tolerant(handler)  # once is enough; a second call wraps nothing
    assert handler.num_nodes_waiting.store_loss_tolerant


def test_a_stale_build_lock_beside_its_built_op_is_taken_over(tmp_path, monkeypatch):
    """take_over_stale_build_locks (every rank's start): a lock nobody holds beside a built .so
    (a process killed after its build) goes; a lock held open by a live build stays, and so does
    a lock with no product yet (a build in progress we may not see)."""
    import subprocess
    import sys

    from launcher.core.jit_locks import take_over_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built, live, building = (tmp_path / name for name in ("built", "live", "building"))
    for folder in (built, live, building):
        folder.mkdir()
        (folder / "lock").touch()
    for folder in (built, live):
        (folder / f"{folder.name}.so").write_bytes(b"\x7fELF")
    with held_open(live / "lock"):
        assert take_over_stale_build_locks() == [str(built / "lock")]
        assert (live / "lock").exists() and (building / "lock").exists()


def test_cpu_ranks_build_no_deepspeed_shm_op(monkeypatch):
    """DeepSpeed's TorchBackend asks build_shm_op() for its inference-only shm op; on a CPU
    process skip_cpu_shm_build makes that a no-op returning None (no JIT build, no lock)."""
    import importlib

    from launcher.engines.compat import skip_cpu_shm_build

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    monkeypatch.setattr(ds_torch, "build_shm_op", ds_torch.build_shm_op)
    skip_cpu_shm_build()
    assert ds_torch.build_shm_op() is None
    assert getattr(ds_torch.build_shm_op, "_trainwright", False)


def test_task_templates_are_compiled_once_and_render_the_same(monkeypatch):
    from lm_eval import utils

    from launcher.engines.compat import compiled_templates_kept

    template, docs = "Question: {{question}}\nAnswer:", [{"question": f"q{i}"} for i in range(5)]
    before = [utils.apply_template(template, d) for d in docs]
    compiles = []
    compile_ = utils.env.from_string
    monkeypatch.setattr(utils.env, "from_string", lambda t: compiles.append(t) or compile_(t))
    monkeypatch.setattr(utils, "apply_template", utils.apply_template)  # undone after the test
    compiled_templates_kept()
    compiled_templates_kept()  # a second call wraps nothing again
    after = [utils.apply_template(template, d) for d in docs]
    assert after == before == [f"Question: q{i}\nAnswer:" for i in range(5)]
    assert compiles == [template]


def test_rendezvous_events_keep_torchs_names_without_reading_the_stack():
    """Inside the launch, the rendezvous names its events by frame (0.4 s of a launch less):
    the same name torch's ``get_method_name`` gives at every depth, "no_method_name" past the
    stack's end, and torch's own function back after the block."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as rendezvous

    from launcher.engines.compat.torch_elastic import (method_name,
                                                       rendezvous_events_named_by_frame)

    by_stack = rendezvous.get_method_name

    def _mark_rendezvous_closed(depth):  # a rendezvous method's call through _record
        return _record(depth)

    def _record(depth):
        return by_stack(depth), rendezvous.get_method_name(depth)

    with rendezvous_events_named_by_frame():
        assert rendezvous.get_method_name is method_name
        names = [_mark_rendezvous_closed(depth) for depth in (1, 2, 3, 10_000)]
    assert rendezvous.get_method_name is by_stack
    assert names == [("_record", "_record"),
                     ("_mark_rendezvous_closed", "_mark_rendezvous_closed"),
                     (names[2][0], names[2][0]), ("no_method_name", "no_method_name")]
    assert names[2][0] == "<listcomp>" or names[2][0].startswith("test_")
