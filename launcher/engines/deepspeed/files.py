"""DeepSpeed's checkpoint files, torch-free: what their names say about the checkpoint
(:func:`saved_layout`) and the record trainwright writes beside them at TP > 1
(:data:`TP_SPLIT_FILE`). The engine's checkpoint IO and the weights reader both read them."""

from __future__ import annotations

import re
from pathlib import Path

_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
ZERO_FORMATS = {0: "ZeRO stage 0", 1: "ZeRO stage 1/2", 2: "ZeRO stage 1/2", 3: "ZeRO stage 3"}
"""Optimizer-state formats: stages 1 and 2 write the same partitions (a resume may switch)."""

TP_SPLIT_FILE = "tensor_parallel.json"
"""How the module's tensor-parallel parameters are split, beside DeepSpeed's files of a
checkpoint written at TP > 1 (``launcher.engines.deepspeed.engine.tensor_parallel_split``)."""


def saved_layout(step_dir: Path) -> dict:
    """TP size, optimizer-state format and (under ZeRO) DP size of the DeepSpeed files in
    ``step_dir``, read from their names (``mp_rank_<tp>_model_states.pt``,
    ``[bf16_]zero_pp_rank_<dp>_mp_rank_<tp>_optim_states.pt``, ZeRO-3's
    ``zero_pp_rank_<dp>_mp_rank_<tp>_model_states.pt``); None where no file tells."""
    tp, dp, stage3 = set(), set(), False
    for path in Path(step_dir).iterdir():
        if match := _MODEL_FILE.match(path.name):
            tp.add(int(match.group(2)))
            stage3 = stage3 or match.group(1) is not None
        elif match := _OPTIM_FILE.match(path.name):
            dp.add(int(match.group(1)))
            tp.add(int(match.group(2)))
    zero = "ZeRO stage 3" if stage3 else ZERO_FORMATS[1] if dp else ZERO_FORMATS[0]
    return {"tp": len(tp) or None, "dp": len(dp) or None, "zero": zero if tp else None}
