"""``python -m launcher.train -m key=a,b ... --cfg job|hydra|all``: the config of every sweep point.

Hydra 1.3 itself refuses ``--cfg`` together with ``--multirun``. Here the sweep is expanded the way
its basic sweeper expands it (``hydra.sweeper.params`` and the command line, Cartesian product),
each point is composed as Hydra's launcher composes it (``load_sweep_config``, with its job number)
and printed as one YAML document, headed by the point's swept values. Nothing runs. When the
sweep starts, it also sets ``run.output_root``, ``run.name`` and ``logger.group`` of every point
(:mod:`launcher.launch.sweep`).
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, open_dict

from launcher.cli.app import compose
from launcher.cli.show import render_cfg


def sweep_points(master: DictConfig) -> list[list[str]]:
    """The overrides of every point of a multirun config, in Hydra's basic sweeper's order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = master.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(master.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [list(point) for point in BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]]


def swept_keys(master: DictConfig) -> set[str]:
    """Keys (or groups) the command line sweeps over."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(master.hydra.overrides.task))
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def show_sweep_cfg(hydra, args) -> None:
    """Print the ``--cfg`` view of every sweep point, documents separated by ``---``."""
    master = compose(hydra, [*args.overrides, "hydra.mode=MULTIRUN"], multirun=True)
    points, swept = sweep_points(master), swept_keys(master)
    docs = []
    for num, point in enumerate(points):
        cfg = hydra.config_loader.load_sweep_config(master, point)
        with open_dict(cfg):
            cfg.hydra.job.id, cfg.hydra.job.num = str(num), num
        values = [o for o in point if o.split("=", 1)[0].lstrip("+~") in swept]
        head = f"# sweep point {num} of {len(points)}: {' '.join(values) or '(no swept keys)'}\n"
        docs.append(head + render_cfg(hydra.get_sanitized_cfg(cfg, args.cfg), args.package,
                                      args.resolve))
    sys.stdout.write("---\n".join(docs))
