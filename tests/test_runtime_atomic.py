"""atomic.py: no temp files left, never a partial file under the final name (SIGKILL mid-write)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.atomic import (atomic_symlink_or_pointer, atomic_write_bytes, atomic_write_json,
                                  atomic_write_text, read_pointer)

REPO_ROOT = Path(__file__).resolve().parent.parent
SIZE = 32 * 1024 * 1024

WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
from launcher.core.atomic import atomic_write_bytes
if __name__ == "__main__":
    i = 1
    while True:
        atomic_write_bytes(sys.argv[1], bytes([i % 251 + 1]) * int(sys.argv[3]))
        i += 1
"""


def test_writes_leave_no_temp_file(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "hello")
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic_write_json(tmp_path / "c.json", {"x": [1, 2], "p": tmp_path})
    atomic_write_text(tmp_path / "a.txt", "again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.json"]
    assert (tmp_path / "a.txt").read_text() == "again"
    assert json.loads((tmp_path / "c.json").read_text())["p"] == str(tmp_path)


def test_failed_write_keeps_old_content_and_removes_temp(tmp_path):
    target = tmp_path / "c.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # fails inside the write
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_pointer_round_trip(tmp_path):
    ptr = tmp_path / "latest"
    assert read_pointer(ptr) is None
    atomic_symlink_or_pointer(ptr, "step_000010")
    atomic_symlink_or_pointer(ptr, "step_000020")
    assert read_pointer(ptr) == "step_000020"
    assert ptr.read_text() == "step_000020\n"
    with pytest.raises(ValueError, match="plain name"):
        atomic_symlink_or_pointer(ptr, "../elsewhere")
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def _wait_for_temp(directory: Path, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "writer exited early"
        if any(p.name.startswith(".big.bin.tmp.") for p in directory.iterdir()):
            return
        time.sleep(0.001)
    raise AssertionError("writer never started a temporary file")


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_sigkill_mid_write_never_leaves_partial_file(tmp_path, delay):
    target = tmp_path / "big.bin"
    atomic_write_bytes(target, b"\xff" * SIZE)  # the old content
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(REPO_ROOT), str(SIZE)])
    try:
        _wait_for_temp(tmp_path, proc)
        time.sleep(delay)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    data = target.read_bytes()
    assert len(data) == SIZE, "final name holds a partial file"
    assert data.count(data[:1]) == SIZE, "final name holds a mix of two writes"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "big.bin"]
    assert all(name.startswith(".big.bin.tmp.") for name in leftovers)
