"""Suite-wide settings and fixtures (``mount_tmpfs``; ``slurm``, from tests/helpers/slurm.py;
``layout_runs``, from tests/helpers/layout_runs.py).
Helpers shared by several test modules live in the tests/helpers package; no test module
imports another.

Every training process the tests start (``tests/helpers/dist.py`` workers and ``python -m
launcher.train`` subprocesses) runs in strict device mode (:mod:`launcher.runtime.strict_devices`):
a collective that would hand a host tensor to NCCL on a GPU machine fails on CPU too. Set
``TRAINWRIGHT_STRICT_DEVICES=0`` in the environment to run the suite without it.
"""

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

# The helpers' asserts (e.g. training.train's exit code) report like the tests' own.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.processes import MARK, kill_marked  # noqa: E402
from tests.helpers.slurm import slurm  # noqa: E402, F401  (the Slurm tests' fixture)
from tests.helpers.layout_runs import layout_runs  # noqa: E402, F401  (one run per layout)

os.environ.setdefault("TRAINWRIGHT_STRICT_DEVICES", "1")
# Machine profiles (launcher/plan/profile.py) of this test session only: a developer's stored
# profile never changes what a test plans, and the tests never write into ~/.cache.
os.environ.setdefault("TRAINWRIGHT_PROFILE_DIR", tempfile.mkdtemp(prefix="trainwright-profiles-"))


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(size)``: a new tmpfs of ``size`` (mount's syntax: ``1m``) under tmp_path, to
    fill a disk for real; needs root and mount (the test is skipped elsewhere). Unmounted lazily
    at teardown: a failed write's file may still be open, held by a traceback."""
    mounts = []

    def mount(size: str) -> Path:
        target = tmp_path / f"tmpfs{len(mounts)}"
        target.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(target)
        return target

    yield mount
    for target in mounts:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """Every process the test starts carries its mark; what still runs when the test ends (a
    run a timed-out subprocess call left, a Slurm job's steps) is killed
    (tests/helpers/processes.py)."""
    mark = f"{os.getpid()}-{request.node.nodeid}"
    os.environ[MARK] = mark
    try:
        yield
    finally:
        os.environ.pop(MARK, None)
        kill_marked(mark)
