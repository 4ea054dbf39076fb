"""Training-state bytes per parameter before any sharding, the accounting every engine's spec
starts from (the ZeRO paper's, Rajbhandari et al. 2020)."""

from __future__ import annotations

from launcher.config import Precision


def mixed_precision_bytes(precision: Precision, grad_fp32: bool) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter before any sharding: 2-byte weights,
    2- or 4-byte gradients and 12 bytes of fp32 master copy + Adam moments under bf16/fp16
    (the ZeRO paper's accounting); 4, 4 and 8 under fp32."""
    mixed = precision != Precision.fp32
    weight = 2 if mixed else 4
    grad = 4 if (grad_fp32 or not mixed) else 2
    return weight, grad, 12 if mixed else 8
