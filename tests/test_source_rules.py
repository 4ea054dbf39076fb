"""Rules of the source that no import contract can state, checked by scanning it (AST, so any
spelling is found, a lazy import inside a function included), each scan shown to catch a planted
example:

- no ``getattr(x, "value", x)`` in launcher/ or data_prep/: the config's enums are StrEnums, so
  ``str(x)`` and comparisons with their values need no unwrapping, and a field that is sometimes
  an enum and sometimes not is the bug that such a call hides (issue 48);
- no test module imports another test module (``from tests.test_x import``, ``import
  tests.test_x``, ``from tests import test_x``), and no helper imports one: what tests share lives
  in tests/helpers/. A ``run_distributed("tests.test_x:worker")`` reference names the module it
  is written in (another module's worker is an import of that module too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = re.compile(r"(tests\.test_\w+):\w+")


def getattr_value_calls(source: str, name: str) -> list[str]:
    """``name:line`` of every ``getattr(<anything>, "value"...)`` in ``source``."""
    lines = sorted(node.lineno for node in ast.walk(ast.parse(source, name))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                   and node.func.id == "getattr" and len(node.args) >= 2
                   and isinstance(node.args[1], ast.Constant) and node.args[1].value == "value")
    return [f"{name}:{line}" for line in lines]


def test_no_getattr_value_in_the_project():
    files = sorted(p for folder in ("launcher", "data_prep") for p in (ROOT / folder).rglob("*.py"))
    assert len(files) > 100
    hits = [hit for p in files for hit in getattr_value_calls(p.read_text(),
                                                              str(p.relative_to(ROOT)))]
    assert hits == [], ("the config's enums are StrEnums: use str(x) or compare with the value "
                        f"instead of getattr(x, 'value', x): {hits}")


def test_the_getattr_scan_finds_a_planted_call():
    sample = ("import enum\n"
              "def shown(x):\n"
              "    return str(getattr(x, 'value', x))\n"
              "def later(cfg):\n"
              "    return getattr(\n        cfg.trainer.precision,\n        \"value\")\n"
              "def fine(x):\n"
              "    return getattr(x, 'values', None), x.value\n")
    assert getattr_value_calls(sample, "sample.py") == ["sample.py:3", "sample.py:5"]


def imported_test_modules(source: str, name: str) -> list[str]:
    """``name:line module`` of every test module that ``source`` imports (at any depth) or
    names as another module's worker; ``name`` is its path under the repository."""
    own = name.removesuffix(".py").replace("/", ".")
    found = []
    for node in ast.walk(ast.parse(source, name)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = WORKER.fullmatch(node.value)
            modules = [match.group(1)] if match and match.group(1) != own else []
        found += [(node.lineno, m) for m in modules if re.fullmatch(r"tests\.test_\w+", m)]
    return [f"{name}:{line} {module}" for line, module in sorted(found)]


def test_no_test_module_imports_another():
    files = sorted((ROOT / "tests").rglob("*.py"))
    assert len(files) > 100
    hits = [hit for p in files for hit in imported_test_modules(p.read_text(),
                                                              str(p.relative_to(ROOT)))]
    assert hits == [], f"move what tests share into tests/helpers/: {hits}"


def test_the_test_import_scan_finds_every_spelling():
    sample = ("import json\n"
              "import tests.test_plan\n"
              "from tests.test_slurm_jobs import submit\n"
              "from tests import test_collectives, helpers\n"
              "from tests.helpers.slurm import wait_job\n"
              "def worker():\n"
              "    from tests.test_engine_deepspeed import run_layout\n"
              "    run_distributed('tests.test_sample:mine', 2)\n"
              "    run_distributed('tests.test_megatron_engine:layouts_worker', 2)\n"
              "    '''A docstring naming tests.test_plan:worker is no reference.'''\n")
    assert imported_test_modules(sample, "tests/test_sample.py") == [
        "tests/test_sample.py:2 tests.test_plan",
        "tests/test_sample.py:3 tests.test_slurm_jobs",
        "tests/test_sample.py:4 tests.test_collectives",
        "tests/test_sample.py:7 tests.test_engine_deepspeed",
        "tests/test_sample.py:9 tests.test_megatron_engine"]
