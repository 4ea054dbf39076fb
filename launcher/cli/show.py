"""What ``--cfg``, ``--info`` and ``--version`` print, by Hydra's own code
(``hydra._internal.hydra.Hydra``: composition, sanitising the config for ``--cfg job|hydra|all``,
the ``--info`` reports)."""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import sys

from omegaconf import Container, DictConfig, OmegaConf

from launcher.cli.app import CONFIG_NAME, compose
from launcher.compose import ConfigError

_ABSENT = object()


def render_cfg(cfg: DictConfig, package: str | None, resolve: bool) -> str:
    """``--cfg``'s text: the config or its ``-p`` package as YAML (a single value: the value)."""
    if package in (None, "", "_global_"):
        package, node = None, cfg
    else:
        node = OmegaConf.select(cfg, package, default=_ABSENT)
        if node is _ABSENT:
            raise ConfigError(f"package '{package}' not found in config{_near(cfg, package)}")
    if not isinstance(node, Container):
        return f"{node}\n"
    if resolve:
        OmegaConf.resolve(node)
    return (f"# @package {package}\n" if package else "") + OmegaConf.to_yaml(node)


def _near(cfg: DictConfig, package: str) -> str:
    """'; did you mean ...' for a ``-p`` key, or the keys that are there."""
    parent, _, last = package.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if not isinstance(node, DictConfig):
        return ""
    keys = [str(key) for key in node.keys()]
    close = difflib.get_close_matches(last, keys, n=3)
    prefix = f"{parent}." if parent else ""
    if close:
        return "; did you mean " + " or ".join(prefix + key for key in close) + "?"
    return f"; keys{' of ' + parent if parent else ''}: {', '.join(keys)}"


def show_cfg(hydra, args) -> None:
    """``--cfg job|hydra|all [-p key] [--resolve]``: print the composed config, run nothing."""
    cfg = compose(hydra, args.overrides)
    sys.stdout.write(render_cfg(hydra.get_sanitized_cfg(cfg, args.cfg), args.package,
                                args.resolve))


def show_info(hydra, info: str, overrides: list[str]) -> None:
    """``--info [all|config|defaults|defaults-tree|plugins|searchpath]``: Hydra's report (it logs
    to stdout); the root logger is put back as it was afterwards."""
    compose(hydra, overrides)  # a config error exits 2 here, before the report starts
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):  # Hydra's log handler writes to sys.stdout
            hydra.show_info(info, config_name=CONFIG_NAME, overrides=list(overrides))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    sys.stdout.write(report.getvalue())


def show_version(prog: str) -> None:
    """``--version``: trainwright's and Hydra's versions."""
    from importlib.metadata import PackageNotFoundError, version

    import hydra

    try:
        own = version("trainwright")
    except PackageNotFoundError:
        own = "unknown"
    print(f"{prog} (trainwright {own})\nHydra {hydra.__version__}")
