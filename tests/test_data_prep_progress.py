"""Progress where nobody watches a terminal (a Slurm log, a pipe): plain lines every
``progress_every_s`` seconds instead of a bar that rich would only draw once, at the end."""

from __future__ import annotations

import re
import time

import pytest
from tests.helpers.data_prep import prepare, stdlib_documents, write_jsonl

from data_prep.progress import RunProgress
from data_prep.stats import Stats

LINE = re.compile(r"data_prep: (\d+\.\d)% \(([\d.]+) of ([\d.]+) MB\), ([\d,]+) docs, "
                  r"[\d.]+M tok/s, [\d.]+ MB/s, \d+:\d\d:\d\d left$")


def test_a_line_gives_share_rates_and_time_left(capsys):
    with RunProgress(2 * 10**9, 5 * 10**8, enabled=True, every_s=3600) as progress:
        progress.done.merge(Stats(documents=1234, tokens=2 * 10**9, input_bytes=5 * 10**8), 0)
        progress.started = time.perf_counter() - 10.0
        line = progress.line()
    assert line == ("data_prep: 50.0% (1.0 of 2.0 GB), 1,234 docs, 200.0M tok/s, 50.0 MB/s, "
                    "0:00:20 left")
    assert capsys.readouterr().err == ("data_prep: tokenizing 1.5 GB of input (0.5 GB already in "
                                       "kept shards); a progress line every 3600 s\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    return write_jsonl(root / "a.jsonl", stdlib_documents(200, offset=500, max_chars=12_000))


def _run(corpus, tmp_path, *overrides):
    return prepare(f"input={corpus}", f"output={tmp_path / 'out'}", "tokenizer.kind=byte",
                   "workers=1", "block_bytes=16384", "progress=true", *overrides, check=False)


def test_a_log_gets_plain_lines_that_move_forward(corpus, tmp_path):
    proc = _run(corpus, tmp_path, "progress_every_s=0.001")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "data_prep: tokenizing 1.0 MB of input; a progress line every 0.001 s"
    found = [LINE.match(line) for line in lines[1:]]
    assert len(found) >= 3 and all(found), proc.stderr  # nothing else: no bar drawn at the end
    shares = [float(m.group(1)) for m in found]
    docs = [int(m.group(4).replace(",", "")) for m in found]
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] <= 100.0
    assert docs == sorted(docs) and docs[-1] <= 200
    assert "━" not in proc.stderr and "wrote" in proc.stdout


def test_no_lines_with_zero_and_a_negative_interval_is_a_config_error(corpus, tmp_path):
    quiet = _run(corpus, tmp_path, "progress_every_s=0")
    assert quiet.returncode == 0 and quiet.stderr == ""
    bad = _run(corpus, tmp_path, "progress_every_s=-1")
    assert bad.returncode == 2 and "progress_every_s=-1.0 must be >= 0" in bad.stderr
