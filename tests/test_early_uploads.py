"""A checkpoint's files go to the store as they are closed, against a real S3 server
(SeaweedFS): a file closed mid-write is in the store before the write ends, a file changed
after it was sent is left to the upload after the write, a temporary file renamed into place
leaves no key behind, and the processes of a node split the files by bytes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from launcher.core import objectstore
from launcher.core.objectstore import ObjectURI
from launcher.runtime.early_uploads import EarlyUploads
from tests.helpers.s3 import serve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("s3_store")]

BUCKET = "early"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    yield from serve(tmp_path_factory, BUCKET)


@pytest.fixture
def store(s3, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    objectstore._client.cache_clear()
    objectstore._manager.cache_clear()
    yield s3
    objectstore._client.cache_clear()
    objectstore._manager.cache_clear()


def _write(path: Path, data: bytes, mode: str = "wb") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as handle:
        handle.write(data)


def _wait_for_key(s3, key: str, size: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s3.keys(BUCKET, key).get(key) == size:
            return True
        time.sleep(0.1)
    return False


def _names(early: EarlyUploads, kept: dict) -> list:
    return sorted(path.relative_to(early.staged).as_posix() for path, _ in kept)


def _body(s3, key: str) -> bytes:
    return s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_a_file_closed_during_the_write_is_in_the_store_before_the_write_ends(store, tmp_path):
    """The file sits in the staged folder itself: a file closed a moment after its subfolder was
    made may be closed before the watch covers that subfolder (inotify adds the subfolder's
    watch on its creation event), and is then sent after the write; a loaded CI host once
    took that path here."""
    staged, folder = tmp_path / "step_000001.tmp", ObjectURI(BUCKET, "run/step_000001")
    early = EarlyUploads(staged, folder).start()
    first = os.urandom(3 * 2**20)
    _write(staged / "__0_0.distcp", first)
    # the "write" goes on: nothing has told the uploads it ended, yet the file is there
    assert _wait_for_key(store, folder.key("__0_0.distcp"), len(first))
    _write(staged / "common.pt", b"x" * 1000)
    time.sleep(1.0)  # the watch's events arrive (one still on its way is sent after the write)
    kept = early.stop(time.monotonic() + 30)
    assert _names(early, kept) == ["__0_0.distcp", "common.pt"]
    for future in kept.values():
        future.result()
    assert _body(store, folder.key("__0_0.distcp")) == first
    assert _body(store, folder.key("common.pt")) == b"x" * 1000


def test_a_file_changed_after_it_was_sent_is_left_to_the_upload_after_the_write(store,
                                                                                 tmp_path):
    staged, folder = tmp_path / "s", ObjectURI(BUCKET, "run/step_000002")
    early = EarlyUploads(staged, folder).start()
    _write(staged / "rewritten.pt", b"a" * 4096)
    assert _wait_for_key(store, folder.key("rewritten.pt"), 4096)
    _write(staged / "rewritten.pt", b"b" * 100, "ab")  # closed a second time
    _write(staged / "kept.pt", b"k" * 10)
    time.sleep(1.0)  # the watch's events arrive
    kept = early.stop(time.monotonic() + 30)
    assert _names(early, kept) == ["kept.pt"]


def test_a_temporary_file_renamed_into_place_leaves_no_key(store, tmp_path):
    staged, folder = tmp_path / "s", ObjectURI(BUCKET, "run/step_000003")
    early = EarlyUploads(staged, folder).start()
    _write(staged / "trainwright.json.tmp", b"{}" * 100)
    time.sleep(1.0)  # its upload may well have begun before the rename
    os.replace(staged / "trainwright.json.tmp", staged / "trainwright.json")
    time.sleep(1.0)
    kept = early.stop(time.monotonic() + 30)
    for future in kept.values():
        future.result()
    assert _names(early, kept) == ["trainwright.json"]
    assert set(store.keys(BUCKET, "run/step_000003/")) == {folder.key("trainwright.json")}


def test_the_processes_of_a_node_split_the_files_by_bytes_without_talking(store, tmp_path):
    staged, folder = tmp_path / "s", ObjectURI(BUCKET, "run/step_000004")
    for sub in ("megatron", "rng"):  # a file in a folder made a moment before may go unseen
        (staged / sub).mkdir(parents=True)
    watches = [EarlyUploads(staged, folder, share=(i, 2)).start() for i in range(2)]
    sizes = {"megatron/__0_0.distcp": 2**20, "megatron/__0_1.distcp": 2**20,
             "megatron/__1_0.distcp": 2**20, "megatron/__1_1.distcp": 2**20,
             "common.pt": 1000, "rng/rank_0.pt": 10}
    for name, size in sizes.items():
        _write(staged / name, os.urandom(size))
    time.sleep(1.0)
    kept = [w.stop(time.monotonic() + 30) for w in watches]
    names = [_names(w, k) for w, k in zip(watches, kept)]
    assert sorted(names[0] + names[1]) == sorted(sizes)  # each file once
    big = [sum(sizes[n] for n in mine if n.endswith(".distcp")) for mine in names]
    assert big == [2 * 2**20, 2 * 2**20], names  # the large files split evenly
    for k in kept:
        for future in k.values():
            future.result()
    assert set(store.keys(BUCKET, "run/step_000004/")) == {folder.key(n) for n in sizes}


def test_a_save_without_inotify_to_spare_uploads_everything_after_the_write(tmp_path,
                                                                           monkeypatch):
    from launcher.runtime import early_uploads
    from launcher.runtime.checkpoint_store import StoreUploads

    def no_instances(self):
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr(early_uploads.Observer, "start", no_instances)
    uploads = StoreUploads(ObjectURI(BUCKET, "run"), retry_s=5)
    uploads.watch(tmp_path / "step_000005.tmp", 5)
    assert uploads.early is None  # the save goes on; begin() shares out every file
