"""Parse Hydra's flags on an entry point's command line and act on them, as ``@hydra.main`` does.

``handle_flags(argv, prog, doc)`` is the first thing every entry point does. A command line
without flags (launcher.train: or with only ``-m``/``--multirun``) is returned untouched. Otherwise
the informational flags print and exit 0; ``--run`` is dropped and the overrides are returned;
an unknown flag, a wrong combination or a config error prints one message and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from launcher.core.exits import CONFIG_ERROR_EXIT

ENTRY_POINTS = ("launcher.train", "launcher.plan", "launcher.submit", "launcher.search")
"""The Hydra-style commands (shell completion covers them all)."""
SWEEP_FLAGS = ("-m", "--multirun")
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
NOT_TAKEN = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
             "--experimental-rerun")
"""Hydra flags these commands do not take: they always compose conf/config.yaml."""


class FlagError(Exception):
    """A command line the flags parser rejects; the message says why."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises FlagError instead of printing its usage and exiting."""

    def error(self, message: str):
        raise FlagError(message)


def build_parser(prog: str, multirun: bool) -> argparse.ArgumentParser:
    """Hydra's flags (``hydra._internal.utils.get_args_parser``) that ``prog`` takes."""
    p = _Parser(prog=f"python -m {prog}", add_help=False, allow_abbrev=False)
    p.add_argument("--help", "-h", action="store_true", help="Application's help")
    p.add_argument("--hydra-help", action="store_true", help="Hydra's help")
    p.add_argument("--version", action="store_true", help="Show the versions and exit")
    p.add_argument("overrides", nargs="*", help="Any key=value arguments to override config "
                   "values (use dots for.nested=overrides)")
    p.add_argument("--cfg", "-c", choices=["job", "hydra", "all"],
                   help="Show config instead of running [job|hydra|all]")
    p.add_argument("--resolve", action="store_true", help="Used in conjunction with --cfg, "
                   "resolve config interpolations before printing.")
    p.add_argument("--package", "-p", help="Config package to show")
    p.add_argument("--run", "-r", action="store_true", help="Run a job (the default)")
    if multirun:
        p.add_argument("--multirun", "-m", action="store_true", help="Run one job per sweep "
                       "point; with --cfg: show each point's config")
    p.add_argument("--shell-completion", "-sc", action="store_true",
                   help="Install or uninstall shell completion: -sc install=bash|zsh|fish "
                   "(uninstall=...)")
    p.add_argument("--info", "-i", const="all", nargs="?", choices=INFO_CHOICES,
                   help=f"Print Hydra information [{'|'.join(INFO_CHOICES)}]")
    return p


def refuse_flags(argv: Sequence[str], prog: str, multirun: bool) -> None:
    """FlagError for a Hydra flag ``prog`` does not take (``--config-name``; ``-m`` on plan)."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in NOT_TAKEN:
            raise FlagError(f"{flag} is a Hydra flag {prog} does not take: it always composes "
                            "conf/config.yaml (TRAINWRIGHT_CONF moves the config tree)")
        if flag in SWEEP_FLAGS and not multirun:
            raise FlagError(f"{flag}: {prog} runs no sweeps; -m/--multirun is for launcher.train")


def check_combination(args, multirun: bool) -> None:
    """FlagError for flags that do not go together (Hydra's rules; ``-m`` goes with ``--cfg``)."""
    commands = [args.run, args.cfg is not None and not args.multirun, args.multirun,
                args.shell_completion, args.info is not None]
    if sum(commands) > 1 and not (args.help or args.hydra_help or args.version):
        raise FlagError("only one of --run, --multirun, --cfg, --info and --shell-completion can "
                        "be given" + (" (-m/--multirun goes with --cfg)" if multirun else ""))
    if args.resolve and args.cfg is None and not args.help:
        raise FlagError("--resolve can only be used in conjunction with --cfg or --help")
    if args.package is not None and args.cfg is None:
        raise FlagError("--package/-p selects what --cfg shows; give --cfg job|hydra|all too")


def parse(argv: Sequence[str], prog: str, multirun: bool):
    """(parser, namespace) of a command line; FlagError for anything Hydra or ``prog`` rejects."""
    from launcher.cli.completion import parse_request

    refuse_flags(argv, prog, multirun)
    parser = build_parser(prog, multirun)
    try:
        args = parser.parse_intermixed_args(list(argv))
    except FlagError as exc:
        hint = " (write --info all before overrides, or put --info last)" \
            if "--info" in str(exc) and "=" in str(exc) else ""
        raise FlagError(f"{exc}{hint}") from None
    args.multirun = getattr(args, "multirun", False)
    check_combination(args, multirun)
    if args.shell_completion:
        try:
            args.completion = parse_request(args.overrides)
        except ValueError as exc:
            raise FlagError(str(exc)) from None
    return parser, args


def supported(parser: argparse.ArgumentParser) -> str:
    """The flags of a parser, for error messages."""
    return ", ".join("/".join(a.option_strings) for a in parser._actions if a.option_strings)


def handle_flags(argv: Sequence[str], prog: str, doc: str | None,
                 multirun: bool = False) -> list[str]:
    """``argv`` with Hydra's flags acted on: untouched without flags, the overrides after
    ``--run``; every informational flag prints and raises SystemExit(0), every error exits 2."""
    argv = list(argv)
    flags = {arg for arg in argv if arg.startswith("-")}
    if not flags or (multirun and flags <= set(SWEEP_FLAGS)):
        return argv
    try:
        parser, args = parse(argv, prog, multirun)
    except FlagError as exc:
        print(f"{prog}: {exc}\nsupported flags: {supported(build_parser(prog, multirun))}; "
              f"see python -m {prog} --help", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    if not (args.help or args.hydra_help or args.version or args.cfg or args.info
            or args.shell_completion):
        return (["--multirun"] if args.multirun else []) + args.overrides
    try:
        act(parser, args, prog, doc)
        sys.stdout.flush()
    except BrokenPipeError:  # e.g. `--info | head`: the reader has gone, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0)


def act(parser, args, prog: str, doc: str | None) -> None:
    """Print what the one informational flag asks for (config errors exit 2)."""
    from launcher.cli import completion, help_pages, multirun, show
    from launcher.cli.app import hydra_app

    if args.version:
        return show.show_version(prog)
    with hydra_app(prog) as hydra:
        if args.help:
            help_pages.app_help(hydra, parser, prog, doc, args)
        elif args.hydra_help:
            help_pages.hydra_help(hydra, parser, args.overrides)
        elif args.cfg and args.multirun:
            multirun.show_sweep_cfg(hydra, args)
        elif args.cfg:
            show.show_cfg(hydra, args)
        elif args.shell_completion:
            completion.shell_completion(hydra, args.completion, ENTRY_POINTS)
        else:
            show.show_info(hydra, args.info, args.overrides)
