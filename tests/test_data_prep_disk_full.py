"""A full output disk (data_prep.output_space): a warning as soon as the rest will not fit, an
error that names the directory, the shards kept and the space still needed, nothing half-written,
and a re-run (in place or from a moved directory) that finishes with the bytes of a run that never
ran out of space."""

from __future__ import annotations

import errno
import shutil

import pytest
from tests.helpers.data_prep import load, prepare, shard_bytes, stdlib_documents, write_jsonl

from data_prep.output_space import INDEX_BYTES_PER_DOCUMENT, OutputFullError, OutputSpace
from data_prep.stats import Stats
from launcher.core.exits import FAILURE_EXIT

ARGS = ["tokenizer.kind=byte", "block_bytes=65536", "shard_tokens=50000", "name=c"]


def _space(tmp_path, total_input, **kw):
    warnings = []
    return OutputSpace(str(tmp_path), "c", total_input, 2, warn=warnings.append, **kw), warnings


def test_the_warning_projects_the_rest_from_bytes_out_per_byte_in(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    space, warnings = _space(tmp_path, total_input=free + 1000)
    space.observe(Stats(documents=10, tokens=1000, input_bytes=1000))
    ratio = (1000 * 2 + 10 * INDEX_BYTES_PER_DOCUMENT) / 1000
    assert space.output_per_input_byte() == pytest.approx(ratio)
    assert len(warnings) == 1 and f"{ratio:.2f} bytes per input byte" in warnings[0]
    assert str(tmp_path) in warnings[0] and "resumes after the last committed shard" in warnings[0]
    space.next_check = 0.0
    space.observe(Stats(documents=10, tokens=1000, input_bytes=1000))
    assert len(warnings) == 1  # once per run


def test_no_warning_while_the_rest_fits_or_before_any_output(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    space, warnings = _space(tmp_path, total_input=free // 4)
    space.observe(Stats(input_bytes=1000))  # blank lines only: nothing to project from
    assert space.next_check == 0.0
    space.observe(Stats(documents=1, tokens=100, input_bytes=1000))
    assert warnings == [] and space.next_check > 0


def test_a_resume_counts_only_the_input_after_its_kept_shards(tmp_path):
    """The kept shards' input is done: what is left to come must leave it out."""
    free = shutil.disk_usage(tmp_path).free
    space, warnings = _space(tmp_path, total_input=free + free // 4, kept_shards=1, kept_input=free)
    space.observe(Stats(documents=1, tokens=1000, input_bytes=1000))
    assert warnings == []
    entries = [{"stats": Stats(input_bytes=free).to_dict()}, {"stats": Stats(input_bytes=500).to_dict()}]
    space.committed(entries)  # the kept shard, then this run's first: only the new one is added
    assert space.committed_shards == 2 and space.committed_input == free + 500


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_or_quota_becomes_output_full_error(tmp_path, code):
    space, _ = _space(tmp_path, total_input=5000)
    space.observe(Stats(documents=10, tokens=1000, input_bytes=1000))
    with pytest.raises(OutputFullError) as caught, space.reporting_full_disk():
        try:
            raise OSError(code, "full", str(tmp_path / "c_00000.bin"))
        except OSError as exc:  # as a worker's error arrives: raised again in the main process
            raise RuntimeError("the pool stopped") from exc
    message = str(caught.value)
    assert caught.value.exit_code == FAILURE_EXIT and caught.value.__cause__ is not None
    assert message.startswith(f"no space left under {tmp_path} (")
    assert "no shard was committed" in message and "name=c" in message
    assert "the rest (4.9 KiB of input) needs about 10.7 KiB more at 2.20 bytes per input byte" in message


def test_other_os_errors_pass_through(tmp_path):
    space, _ = _space(tmp_path, total_input=5000)
    with pytest.raises(FileNotFoundError), space.reporting_full_disk():
        raise FileNotFoundError(errno.ENOENT, "gone", "x")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 1 MB of text: 2 MB of uint16 byte tokens, twice the 1 MiB disk below."""
    root = tmp_path_factory.mktemp("diskfull")
    write_jsonl(root / "a.jsonl", stdlib_documents(200, offset=500, max_chars=12_000))
    prepare(f"input={root / 'a.jsonl'}", f"output={root / 'reference'}", "workers=1", *ARGS)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_run_that_fills_its_disk_keeps_its_shards_and_resumes_elsewhere(corpus, mount_tmpfs,
                                                                          tmp_path, workers):
    """workers=1 hits the full disk in the main process, workers=2 in a worker's pwrite too."""
    out = mount_tmpfs("1m") / "c"
    proc = prepare(f"input={corpus / 'a.jsonl'}", f"output={out}", f"workers={workers}", *ARGS,
                   check=False)
    assert proc.returncode == FAILURE_EXIT, proc.stderr
    warning = proc.stderr.index("data_prep: warning: the rest of the output needs about")
    error = proc.stderr.index(f"data_prep: error: no space left under {out} (")
    assert warning < error and "committed shard(s) are kept" in proc.stderr[error:]
    shards = load(out / "manifest.json")["shards"]
    assert shards, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json"] + [s["prefix"] + ext for s in shards for ext in (".bin", ".idx")])
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    prepare(f"input={corpus / 'a.jsonl'}", f"output={moved}", f"workers={workers}", *ARGS)
    assert shard_bytes(moved) == shard_bytes(corpus / "reference")
