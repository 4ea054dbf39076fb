"""ResolvedModel.of is cached on the config's values: a config changed in place resolves afresh,
and two configs with the same values share one resolution."""

from __future__ import annotations

import dataclasses

from launcher.compose import compose_config, to_object
from launcher.shape.model import ResolvedModel


def test_a_model_changed_in_place_is_resolved_again():
    model = to_object(compose_config(["model=tiny"])).model
    before = ResolvedModel.of(model, 1)
    model.num_layers += 2
    after = ResolvedModel.of(model, 1)
    assert after.layers == before.layers + 2
    assert ResolvedModel.of(model, 2).padded_vocab % 2 == 0


def test_equal_configs_share_one_resolution_and_tp_is_part_of_the_key():
    model = to_object(compose_config(["model=tiny"])).model
    twin = dataclasses.replace(model)
    assert ResolvedModel.of(model, 1) is ResolvedModel.of(twin, 1)
    assert ResolvedModel.of(model, 1) is not ResolvedModel.of(model, 2)

