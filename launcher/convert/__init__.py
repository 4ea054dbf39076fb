"""Models in and out: Hugging Face import/export and weight loading at any layout.

``python -m launcher.convert to_hf|from_hf|preset`` (:mod:`.__main__`); :mod:`.mapping` (where
each Megatron-Core tensor lives in an HF checkpoint), :mod:`.hf_config` (HF config.json <->
model group), :mod:`.sources` (HF, engine=megatron and engine=deepspeed weights, read lazily),
:mod:`.fill` (weights into a built model at any TP/PP/VPP/EP), :mod:`.to_hf` and
:mod:`.hf_writer` (streaming export), :mod:`.from_hf` (import through the engines),
:mod:`.model_source` (a checkpoint carries its architecture).
"""
