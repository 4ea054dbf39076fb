"""``python -m launcher.convert to_hf|from_hf|reshard|preset`` (:mod:`.__main__`): models in and
out, checkpoints between layouts.

:mod:`.to_hf` and :mod:`.hf_writer` (streaming export of either engine's checkpoint),
:mod:`.from_hf` (import through the engines at a layout), :mod:`.reshard` (a checkpoint saved
in the fast per-rank optimizer format rewritten so that it resumes at any layout); the weights
themselves are read by :mod:`launcher.engines.weights`.
"""

RANK_MODULES_BY_COMMAND = {
    "from_hf": ("megatron.core.models.gpt", "launcher.convert.from_hf", "torch._dynamo"),
    "reshard": ("megatron.core.models.gpt", "launcher.convert.reshard", "torch._dynamo")}
"""What a rank of each multi-rank command imports, imported for it before it starts
(:func:`launcher.launch.rank_preload.preload_rank_imports`; ``torch._dynamo``: the optimizer's,
see there). Kept in this light module so that the command's first line starts the server, 0.55 s
before the command's own imports."""
