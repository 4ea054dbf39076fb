"""``make demo`` prints the exact command it runs: brackets survive (no rich markup), arguments
with spaces are quoted, and long lines are not wrapped."""

from __future__ import annotations

import shlex

from launcher import demo


def test_the_printed_command_is_the_one_that_runs(capsys, tmp_path):
    out_file = tmp_path / "argv.txt"
    args = ["-c", f"import sys; open({str(out_file)!r}, 'w').write(repr(sys.argv[1:]))",
            f"hydra.searchpath=[file://{tmp_path}/with space/conf]", "data=shards",
            "logger.tags=[a,'b c']", "x" * 150]
    demo.run("a step", args)
    printed = [l for l in capsys.readouterr().out.splitlines() if l.startswith("$ python ")]
    assert len(printed) == 1
    assert shlex.split(printed[0])[2:] == args
    assert out_file.read_text() == repr(args[2:])
