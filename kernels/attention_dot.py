"""The dot the Triton attention kernels share (paged_attention_triton, paged_decode_packed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attention_dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # acc + a @ b, accumulated inside the MMA (no separate add over the [M, D] tile).
    # UPCAST_DOT: Triton's interpreter multiplies bf16 tiles as their raw uint16 bits; fp32
    # operands give what the tensor cores give (bf16 products are exact in fp32).
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
