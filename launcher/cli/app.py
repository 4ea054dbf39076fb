"""Hydra's own app object over ``conf/``, the one ``@hydra.main`` would build, for the flags.

Inside :func:`hydra_app` every Hydra or OmegaConf error (a bad override, a missing option, a
type the schema rejects) is printed as one ``config error:`` line and exits with code 2.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from omegaconf import DictConfig

import launcher.config  # noqa: F401  (registers the schema Hydra's app composes against)
from launcher.compose import CONF_DIR, config_errors, exit_on_config_error

CONFIG_NAME = "config"
"""The primary config every entry point composes (``conf/config.yaml``)."""


@contextmanager
def hydra_app(prog: str) -> Iterator:
    """A ``hydra._internal.hydra.Hydra`` for ``conf/`` with job name ``prog``'s last part; config
    errors inside exit 2; Hydra's global state is cleared on the way out."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    search_path = create_config_search_path(f"file://{CONF_DIR}")
    try:
        with exit_on_config_error(), config_errors():
            yield Hydra.create_main_hydra2(task_name=prog.rsplit(".", 1)[-1],
                                           config_search_path=search_path)
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None


def compose(hydra, overrides: list[str], multirun: bool = False) -> DictConfig:
    """The config with Hydra's node, composed as Hydra's own command line does (RUN or MULTIRUN);
    it becomes the current HydraConfig, so ``${hydra:...}`` resolves."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    cfg = hydra.compose_config(config_name=CONFIG_NAME, overrides=list(overrides), run_mode=mode)
    HydraConfig.instance().set_config(cfg)
    OmegaConf.set_readonly(cfg.hydra, None)  # as Hydra's --cfg does
    return cfg
