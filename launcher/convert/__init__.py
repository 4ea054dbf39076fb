"""``python -m launcher.convert to_hf|from_hf|preset`` (:mod:`.__main__`): models in and out.

:mod:`.to_hf` and :mod:`.hf_writer` (streaming export of either engine's checkpoint),
:mod:`.from_hf` (import through the engines at a layout); the weights themselves are read by
:mod:`launcher.engines.weights`.
"""
