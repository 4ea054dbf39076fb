"""Bad records are skipped and counted by reason, with file:line examples; limits and strict mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.helpers.data_prep import prepare, read_documents, write_parquet

from data_prep.cli import compose
from data_prep.run import execute

BAD_JSONL = b"".join([
    b'\xef\xbb\xbf{"text": "good one"}\n',          # 1 BOM (repaired)
    b'{"text": "good two"}\r\n',                     # 2 CRLF (repaired)
    b'{"text": "broken\n',                           # 3 invalid_json
    b'{"text": "caf\xff"}\n',                        # 4 non_utf8
    b'{"id": 1}\n',                                  # 5 missing_key
    b'{"text": null}\n',                             # 6 null_text
    b'{"text": 42}\n',                               # 7 non_string_text
    b'{"text": ""}\n',                               # 8 empty_text
    b'\n',                                           # 9 blank_line (not bad)
    b'[1, 2]\n',                                     # 10 not_an_object
    b'{"text": "\\ud800"}\n',                        # 11 invalid_unicode (lone surrogate)
    b'{"text": "good three"}\n',                     # 12
    b'{"text": "cut off in the mid',                 # 13 truncated_last_line
])
EXPECTED = {"invalid_json": 1, "non_utf8": 1, "missing_key": 1, "null_text": 1, "non_string_text": 1,
            "empty_text": 1, "blank_line": 1, "not_an_object": 1, "invalid_unicode": 1,
            "truncated_last_line": 1}
LINES = {"invalid_json": 3, "non_utf8": 4, "missing_key": 5, "null_text": 6, "non_string_text": 7,
         "empty_text": 8, "not_an_object": 10, "invalid_unicode": 11, "truncated_last_line": 13}


def _run(tmp_path, *extra):
    cfg = compose([f"input={tmp_path / 'bad.jsonl'}", f"output={tmp_path / 'out'}", "workers=1",
                   "progress=false", *extra])
    return execute(cfg)


@pytest.mark.slow
def test_every_bad_class_is_counted_with_its_line(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(BAD_JSONL)
    totals = _run(tmp_path)["totals"]
    assert totals["documents"] == 3
    assert totals["skipped"] == EXPECTED
    assert totals["repaired"] == {"bom_stripped": 1, "crlf_line_ending": 1}
    assert totals["bad_records"] == 9 and totals["records"] == 12
    for reason, line in LINES.items():
        assert totals["examples"][reason][0].startswith(f"{tmp_path / 'bad.jsonl'}:{line}: "), reason
    docs = [bytes(d[:-1].astype(np.uint8)).decode() for d in read_documents(tmp_path / "out")]
    assert docs == ["good one", "good two", "good three"]


def test_line_numbers_stay_right_across_blocks(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "x" * 50}) for i in range(600)]
    lines[457] = '{"text": broken'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    totals = _run(tmp_path, "block_bytes=1024", "max_bad_fraction=0.5")["totals"]
    assert totals["skipped"] == {"invalid_json": 1} and totals["documents"] == 599
    assert totals["examples"]["invalid_json"][0].startswith(f"{tmp_path / 'bad.jsonl'}:458: ")


def test_too_many_bad_records_exit_3_and_within_limit_exit_0(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(BAD_JSONL)
    args = [f"input={tmp_path / 'bad.jsonl'}", "workers=1"]
    failed = prepare(*args, f"output={tmp_path / 'a'}", check=False)
    assert failed.returncode == 3, failed.stderr
    assert "9 of 12 records were skipped" in failed.stderr and "max_bad_fraction" in failed.stderr
    assert "invalid_json" in failed.stdout and f"{tmp_path / 'bad.jsonl'}:3:" in failed.stdout
    passed = prepare(*args, f"output={tmp_path / 'b'}", "max_bad_fraction=0.8", check=False)
    assert passed.returncode == 0, passed.stderr


def test_strict_stops_at_first_bad_record_naming_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(BAD_JSONL)
    proc = prepare(f"input={tmp_path / 'bad.jsonl'}", f"output={tmp_path / 'out'}", "strict=true",
                   check=False)
    assert proc.returncode == 3
    assert f"{tmp_path / 'bad.jsonl'}:3: invalid_json" in proc.stderr
    assert not list((tmp_path / "out").glob("*.bin"))


def test_parquet_and_text_files_bad_records(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["fine", None, "", "also fine"])
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "ok.txt").write_text("text file")
    (tmp_path / "t" / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "t" / "empty.txt").write_bytes(b"")
    cfg = compose([f"input=[{tmp_path / 'a.parquet'},{tmp_path / 't'}]", f"output={tmp_path / 'out'}",
                   "workers=1", "progress=false", "max_bad_fraction=1"])
    totals = execute(cfg)["totals"]
    assert totals["documents"] == 3
    assert totals["skipped"] == {"null_text": 1, "empty_text": 2, "non_utf8": 1}
    assert totals["examples"]["null_text"] == [f"{tmp_path / 'a.parquet'}:2: 'text' is null"]
    assert totals["examples"]["non_utf8"][0].startswith(f"{tmp_path / 't' / 'latin1.txt'}:1:")


def test_config_errors_exit_2_with_a_fix(tmp_path):
    cases = [([f"input={tmp_path / 'nope.jsonl'}", f"output={tmp_path / 'o'}"], "is not a file"),
             ([f"input={tmp_path}", f"output={tmp_path / 'o'}", "colour=red"], "colour"),
             ([f"input={tmp_path}", f"output={tmp_path / 'o'}", "workers=many"], "workers"),
             ([f"input={tmp_path}", f"output={tmp_path / 'o'}", "tokenizer.kind=hf"], "tokenizer.path"),
             (["output=x"], "input")]
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    for args, needle in cases:
        proc = prepare(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)


def test_output_inside_the_input_directory_is_not_read_back(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    for _ in range(2):
        cfg = compose([f"input={tmp_path}", f"output={tmp_path / 'out'}", "workers=1", "progress=false"])
        assert execute(cfg)["totals"]["documents"] == 2


def test_inputs_without_documents_write_nothing_and_name_the_files(tmp_path):
    """Before: exit 3, yet a manifest saying complete and a data.yaml with ``prefixes: []``."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.jsonl").write_bytes(b"\n  \n\r\n\n")
    (tmp_path / "in" / "empty.jsonl").write_bytes(b"")
    out = tmp_path / "out"
    proc = prepare(f"input={tmp_path / 'in'}", f"output={out}", "workers=1", check=False)
    assert proc.returncode == 3, proc.stderr
    assert "no documents were found in the input(s) " \
           f"{tmp_path / 'in' / 'blank.jsonl'}, {tmp_path / 'in' / 'empty.jsonl'}" in proc.stderr
    assert "blank_line 4" in proc.stderr
    assert not out.exists() or list(out.iterdir()) == [], "nothing under a final name, no lock left"


def test_an_array_task_without_documents_succeeds_and_merge_judges_the_whole(tmp_path):
    """Tasks get whole files, so a task may get only blank ones (or none): it writes its complete,
    empty manifest, and data_prep.merge refuses only when no task found a document."""
    from data_prep.errors import BadDataError
    from data_prep.merge import merge

    (tmp_path / "docs.jsonl").write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    (tmp_path / "blank.jsonl").write_text("\n" * 200)
    for inputs, out in ((["docs.jsonl", "blank.jsonl"], "mixed"), (["blank.jsonl", "blank.jsonl"], "none")):
        for task in range(2):
            spec = ",".join(str(tmp_path / name) for name in inputs)
            manifest = execute(compose([f"input=[{spec}]", f"output={tmp_path / out}", "workers=1",
                                        "progress=false", "num_tasks=2", f"task_index={task}"]))
            assert manifest["complete"]
    assert merge(str(tmp_path / "mixed"))["totals"]["documents"] == 50
    with pytest.raises(BadDataError, match=f"no documents were found in the input\\(s\\) {tmp_path / 'blank.jsonl'}"):
        merge(str(tmp_path / "none"))
    assert not (tmp_path / "none" / "manifest.json").exists() and not (tmp_path / "none" / "data.yaml").exists()
