"""RMSNorm, alone and with the residual add fused in front of it.

The reference follows transformers' Llama RMSNorm operation for operation (square and
mean in float32, scale by rsqrt, cast back, multiply by the weight), so that CPU float32
results are bit-identical to the transformers oracle.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the normed input and the new residual."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def rms_norm(x, weight, eps: float):
    assert x.shape[-1] == weight.shape[0], "weight has one scale per feature"
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float):
    assert x.shape == residual.shape, "residual and input have the same shape"
    return fused_add_rms_norm_ref(x, residual, weight, eps)
