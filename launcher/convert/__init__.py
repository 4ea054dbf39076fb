"""``python -m launcher.convert to_hf|from_hf|reshard|preset`` (:mod:`.__main__`): models in and
out, checkpoints between layouts.

:mod:`.to_hf` and :mod:`.hf_writer` (streaming export of either engine's checkpoint),
:mod:`.from_hf` (import through the engines at a layout), :mod:`.reshard` (a checkpoint saved
in the fast per-rank optimizer format rewritten so that it resumes at any layout); the weights
themselves are read by :mod:`launcher.engines.weights`.
"""
