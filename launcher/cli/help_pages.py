"""The ``--help`` and ``--hydra-help`` pages.

``--help`` follows Hydra's default app help (config groups with their options, the composed
config) with the command's own description (its module docstring: what it does, exit codes) and
its flags added; ``--hydra-help`` fills Hydra's own template (its flags, the ``hydra/`` groups).
"""

from __future__ import annotations

import inspect
import re
import string
from typing import Callable, Iterator

from omegaconf import OmegaConf

from launcher.cli.app import compose

HELP = """{doc}

Usage: python -m {prog} [flags] [overrides]

== Flags ==
{flags}

== Configuration groups ==
Compose your configuration from those groups (group=option)

{groups}
== Config ==
Override anything in the config (foo.bar=value)

{config}
Use --hydra-help to view Hydra specific help"""
"""The app's ``--help`` page (Hydra's default app help, with the app's description and flags)."""


def plain_doc(doc: str | None) -> str:
    """A module docstring as plain text: no reST roles (``:mod:`x``` -> x), no double backquotes."""
    text = re.sub(r":[\w:]+:`~?([^`]+)`", r"\1", inspect.cleandoc(doc or ""))
    return text.replace("``", "")


def config_groups(hydra, keep: Callable[[str], bool]) -> str:
    """Hydra's ``group: option, ...`` lines (``Hydra.format_config_groups``) for the groups ``keep``
    accepts, read from the config repository directly: Hydra's own walk rebuilds a caching
    repository for every group and takes seconds."""
    from hydra.core.object_type import ObjectType

    repo = hydra.config_loader.repository

    def walk(parent: str) -> Iterator[str]:
        for name in repo.get_group_options(parent, ObjectType.GROUP):
            group = f"{parent}/{name}" if parent else name
            yield group
            yield from walk(group)

    lines = [f"{group}: {', '.join(options)}\n" for group in sorted(walk("")) if keep(group)
             and (options := repo.get_group_options(group, ObjectType.CONFIG))]
    return "".join(lines)


def is_hydra_group(group: str) -> bool:
    """Hydra's own groups (``hydra``, ``hydra/launcher``, ...)."""
    return group == "hydra" or group.startswith("hydra/")


def app_help(hydra, parser, prog: str, doc: str | None, args) -> None:
    """``--help``: what the command does, its flags, the config groups it composes with their
    options, and the config composed with the given overrides."""
    cfg = compose(hydra, args.overrides, multirun=args.multirun)
    used = set(cfg.hydra.runtime.choices)
    groups = config_groups(hydra, lambda group: group in used and not is_hydra_group(group))
    job = hydra.get_sanitized_cfg(cfg, "job")
    print(HELP.format(doc=plain_doc(doc), prog=prog, flags=hydra.format_args_help(parser),
                      groups=groups, config=OmegaConf.to_yaml(job, resolve=args.resolve)))


def hydra_help(hydra, parser, overrides: list[str]) -> None:
    """``--hydra-help``: Hydra's own help page (its template: flags, ``hydra/`` config groups)."""
    from hydra.types import RunMode

    cfg = hydra.compose_config(config_name=None, overrides=list(overrides), run_mode=RunMode.RUN)
    template = string.Template(cfg.hydra.hydra_help.template)  # as Hydra.get_help fills it
    print(template.substitute(
        FLAGS_HELP=hydra.format_args_help(parser),
        HYDRA_CONFIG_GROUPS=config_groups(hydra, is_hydra_group),
        APP_CONFIG_GROUPS=config_groups(hydra, lambda group: not is_hydra_group(group)),
        CONFIG=OmegaConf.to_yaml(hydra.get_sanitized_hydra_cfg(cfg))))
