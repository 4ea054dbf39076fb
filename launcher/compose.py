"""Compose the typed config from ``conf/`` and command-line overrides, outside ``@hydra.main``.

Entry points that need exact control of errors (exit code 2 for every config error, one message
naming the key and a fix) compose through :func:`compose_or_exit` instead of letting Hydra print a
traceback.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Iterator, Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from launcher.core.exits import CONFIG_ERROR_EXIT

CONF_DIR = Path(os.environ.get("TRAINWRIGHT_CONF", Path(__file__).resolve().parent.parent / "conf"))
"""The config tree; TRAINWRIGHT_CONF moves it."""


class ConfigError(Exception):
    """A config that cannot be composed or does not validate; the message says how to fix it."""


KEY_ALIASES = {"eval.async": "eval.asynchronous"}
"""Override keys that cannot be field names (``async`` is a Python keyword) -> their field."""


def with_aliases(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with every aliased key (:data:`KEY_ALIASES`) spelled as its field, prefixes
    (``+``, ``++``, ``~``) kept."""
    out = []
    for override in overrides:
        body = override.lstrip("+~")
        key, sep, value = body.partition("=")
        if key in KEY_ALIASES:
            override = override[:len(override) - len(body)] + KEY_ALIASES[key] + sep + value
        out.append(override)
    return out


def compose_config(overrides: Sequence[str] = (), config_name: str = "config",
                   schema: str = "launcher.config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra override strings; raise ConfigError.
    ``schema``: the module whose import registers that config's schema in Hydra's ConfigStore
    (data_prep's is data_prep.config; it skips the ~20 ms the training schema takes to import)."""
    importlib.import_module(schema)
    with config_errors():
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=with_aliases(overrides))
        OmegaConf.resolve(cfg)
        missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required keys have no value: {', '.join(missing)}; set them in conf/ "
                          "or on the command line (key=value)")
    return cfg


@contextmanager
def config_errors() -> Iterator[None]:
    """Turn the Hydra and OmegaConf errors raised inside into one ConfigError message."""
    try:
        yield
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(_describe(exc)) from None


@contextmanager
def exit_on_config_error() -> Iterator[None]:
    """A ConfigError raised inside: print it to stderr and exit with code 2."""
    try:
        yield
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None


def _describe(exc: Exception) -> str:
    """One readable message: Hydra's summary, the schema's reason and, for a typo, the fix."""
    text = str(exc).strip().split("\nTo append to your config")[0]
    cause = exc.__cause__
    if cause is not None:
        reason = str(cause).strip().splitlines()[0]
        text = f"{text.rstrip('.')}: {reason}"
        hint = _close_key(cause)
        if hint:
            text += f"; did you mean {hint}?"
    if "Could not find" in text or "not found in" in text:
        text += f"\n(config tree: {CONF_DIR})"
    return text


def _close_key(cause: BaseException) -> str:
    """For 'Key x not in SomeConfig', the closest field names of that schema."""
    key, schema = getattr(cause, "key", None), getattr(cause, "object_type", None)
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not key \
            or schema is None or not is_dataclass(schema):
        return ""
    full_key = getattr(cause, "full_key", "") or str(key)
    prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    names = difflib.get_close_matches(str(key), [f.name for f in fields(schema)], n=3)
    return " or ".join(prefix + name for name in names)


def compose_or_exit(argv: Sequence[str], config_name: str = "config") -> DictConfig:
    """Compose from ``argv`` overrides; on error print it to stderr and exit with code 2."""
    with exit_on_config_error():
        return compose_config(argv, config_name=config_name)


def to_object(cfg: DictConfig):
    """The typed dataclass tree behind a composed config (``TrainwrightConfig``)."""
    return OmegaConf.to_object(cfg)
