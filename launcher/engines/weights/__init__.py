"""Model weights in and out of the engines' checkpoints, at any layout.

:mod:`.mapping` (where each Megatron-Core tensor lives in a Hugging Face checkpoint),
:mod:`.hf_config` and :mod:`.hf_export` (HF ``config.json`` <-> the model group, torch-free),
:mod:`.sources` (the weights of an HF directory and of either engine's step directory, read
tensor by tensor) and :mod:`.fill` (those weights into a built model at any TP/PP/VPP/EP). ``trainer.init_from``,
``launcher.generate`` and ``launcher.convert`` read weights only through them.
"""
