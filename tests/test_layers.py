"""The floor plan (pyproject.toml [tool.importlinter], docs/architecture.md): every import of
launcher and data_prep, lazy ones inside functions included, points down the layers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"]


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([*LINT, "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


def test_an_upward_import_inside_a_function_breaks_them(tmp_path):
    for name in ("launcher", "data_prep"):
        shutil.copytree(REPO / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    for module, target in (("launcher/plan/flops.py", "launcher.runtime import loop"),
                           ("data_prep/contamination.py", "launcher.evals import ledger")):
        path = tmp_path / module
        path.write_text(path.read_text() + (
            f"\n\ndef _upward():\n    from {target}  # noqa: F401\n"))
    proc = lint(tmp_path)
    assert proc.returncode != 0
    assert "launcher's layers import only downwards BROKEN" in proc.stdout
    assert "launcher.plan.flops -> launcher.runtime.loop" in proc.stdout, proc.stdout[-3000:]
    assert "data_prep stands on launcher.core and launcher.compose only BROKEN" in proc.stdout
    assert "data_prep.contamination -> launcher.evals.ledger" in proc.stdout, proc.stdout[-3000:]


def test_the_contracts_name_every_package_of_launcher():
    """A package the layers do not list is free to import anything, and one the data_prep
    contract does not forbid is open to data_prep: neither may be left out."""
    import pkgutil
    import tomllib

    packages = {f"launcher.{m.name}" for m in pkgutil.iter_modules([str(REPO / "launcher")])}
    contracts = {c["name"]: c for c in tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["importlinter"]["contracts"]}
    [layers] = [c for c in contracts.values() if c["type"] == "layers"]
    layered = [name.strip() for layer in layers["layers"] for name in layer.split("|")]
    assert sorted(layered) == sorted(packages)
    data_prep = contracts["data_prep stands on launcher.core and launcher.compose only"]
    assert sorted(data_prep["forbidden_modules"]) == sorted(
        packages - {"launcher.core", "launcher.compose"})


def _loaded_after_import(package: str) -> set:
    code = ("import importlib, pkgutil, sys; import {p}; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages({p}.__path__, '{p}.')]; "
            "print(' '.join(sorted({{n.split('.')[0] for n in sys.modules}})))").format(p=package)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=120)
    return set(proc.stdout.split())


def test_the_ground_loads_neither_torch_nor_hydra():
    loaded = _loaded_after_import("launcher.core")
    assert "launcher" in loaded and not loaded & {"torch", "hydra", "omegaconf", "numpy"}


def test_the_shape_and_the_engine_specs_load_no_torch():
    for package in ("launcher.shape", "launcher.engines"):
        code = f"import sys, {package}; print('torch' in sys.modules)"
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, check=True, timeout=120)
        assert proc.stdout.strip() == "False", package
