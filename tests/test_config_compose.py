"""Every YAML option of conf/ composes into the typed schema and becomes a dataclass object."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.compose import CONF_DIR, ConfigError, compose_config, to_object
from launcher.config import (ClusterConfig, DataConfig, DataFormat, EngineConfig, EvalConfig,
                             EvalFormat, GenerateFormat, LoggerConfig, ModelConfig,
                             OptimizerConfig, ParallelismConfig, Recompute, ResilienceConfig,
                             TrainerConfig, TrainwrightConfig)

SCHEMA_OF_GROUP = {
    "model": ModelConfig, "parallelism": ParallelismConfig, "data": DataConfig,
    "optimizer": OptimizerConfig, "trainer": TrainerConfig, "cluster": ClusterConfig,
    "engine": EngineConfig, "logger": LoggerConfig, "resilience": ResilienceConfig,
    "eval": EvalConfig,
}
# Groups composed by other primary configs (tested next to their own app).
OTHER_APPS = {"data_prep"}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_group_directory_is_known():
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    assert groups - OTHER_APPS == set(SCHEMA_OF_GROUP) | {"experiment", "hydra"}


@pytest.mark.parametrize("group,option", [(g, o) for g in SCHEMA_OF_GROUP for o in _options(g)])
def test_group_option_composes_to_object(group, option):
    cfg = to_object(compose_config([f"{group}={option}"]))
    assert isinstance(cfg, TrainwrightConfig)
    node = getattr(cfg, group)
    assert isinstance(node, SCHEMA_OF_GROUP[group])
    raw = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    for key, value in raw.items():  # every value in the file reached the object
        assert _reached(getattr(node, key), OmegaConf.to_container(value)
                        if OmegaConf.is_config(value) else value), key


def _reached(got, value) -> bool:
    """``got`` (enum, dataclass, list of dataclasses) holds every value the YAML gave."""
    if dataclasses.is_dataclass(got):
        return all(_reached(getattr(got, k), v) for k, v in value.items())
    if isinstance(got, list):
        return len(got) == len(value) and all(_reached(g, v) for g, v in zip(got, value))
    return (got.value if hasattr(got, "value") else got) == value


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_experiment_composes_to_object(experiment):
    cfg = to_object(compose_config([f"experiment={experiment}"]))
    assert isinstance(cfg, TrainwrightConfig)


def test_expected_presets_exist():
    assert {"tiny", "gpt2_124m", "llama3_1b", "llama3_8b", "llama3_70b", "llama3_405b",
            "mixtral_8x7b"} <= set(_options("model"))
    assert {"local_cpu", "local_gpu", "slurm_h100", "slurm_h200"} <= set(_options("cluster"))
    assert set(_options("engine")) == {"deepspeed", "megatron"}
    assert set(_options("logger")) == {"none", "wandb", "tensorboard"}
    assert "llama3_70b_16k_h100" in _options("experiment")


def test_enums_are_typed():
    cfg = to_object(compose_config(["trainer.activation_recompute=selective"]))
    assert cfg.trainer.activation_recompute is Recompute.selective


def test_the_three_format_fields_are_distinct_enums():
    """data.format (what the shards hold), generate.format and eval.format (what a command
    prints) are three StrEnums, each refusing the others' values at compose."""
    cfg = to_object(compose_config(["data.format=chat", "generate.format=json",
                                    "eval.format=json"]))
    assert cfg.data.format is DataFormat.chat and cfg.generate.format is GenerateFormat.json
    assert cfg.eval.format is EvalFormat.json
    default = to_object(compose_config([]))
    assert (default.data.format, default.generate.format, default.eval.format) == (
        DataFormat.text, GenerateFormat.text, EvalFormat.text)
    with pytest.raises(ConfigError, match=r"data\.format=json.*expected one of \[text, chat\]"):
        compose_config(["data.format=json"])


@pytest.mark.parametrize("override,fragment", [
    (["model.hidden_sizee=3"], "hidden_sizee"),
    (["model.hidden_size=abc"], "hidden_size"),
    (["trainer.activation_recompute=partial"], "activation_recompute"),
    (["parallelism.sequence_parallel=maybe"], "sequence_parallel"),
    (["model=no_such_model"], "no_such_model"),
    (["data.format=yaml"], "data.format"),
    (["generate.format=yaml"], "generate.format"),
    (["eval.format=table"], "eval.format"),
])
def test_typos_and_wrong_types_fail_at_compose(override, fragment):
    with pytest.raises(ConfigError) as info:
        compose_config(override)
    assert fragment in str(info.value)


def test_seq_length_is_owned_by_model_only():
    cfg = compose_config([])
    owners = [group for group in cfg if isinstance(cfg[group], dict) or OmegaConf.is_dict(cfg[group])
              if "seq_length" in cfg[group]]
    assert owners == ["model"]


def test_every_schema_field_has_a_docstring():
    source = (Path(__file__).parent.parent / "launcher" / "config.py").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(source[:-1]):
        stripped = line.strip()
        is_field = (line.startswith("    ") and not line.startswith("     ") and ":" in stripped
                    and " = " in stripped and not stripped.startswith(("def ", '"', "#")))
        if is_field and not source[i + 1].strip().startswith('"""'):
            undocumented.append(stripped)
    assert undocumented == []


@pytest.mark.parametrize("option", _options("data_prep"))
def test_data_prep_option_composes_to_object(option):
    import data_prep.config as prep  # registers prepare_schema

    cfg = to_object(compose_config([f"data_prep={option}", "input=[corpus.jsonl]", "output=out"],
                                   config_name="prepare"))
    assert isinstance(cfg, prep.PrepareConfig)
    assert cfg.input == ["corpus.jsonl"] and cfg.output == "out"
