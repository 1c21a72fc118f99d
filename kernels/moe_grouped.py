"""The experts as torch's grouped GEMM (`F.grouped_mm`, CUTLASS on sm90) over expert-sorted
slots: for batches that give every expert a long run of tokens (a prefill chunk through
few, large experts), where it beats kernels/moe_triton.py.

Measured on an H100 (benchmarks/moe_bench.py, `moe_bench_h100_d935e2b.json`, µs a layer):
Mixtral's experts (8 of intermediate 14,336, 2 picks) at 8,192 tokens, 2,048 slots an
expert: the Triton kernels 22,185, the grouped GEMM 10,751; at 512 tokens (128 slots an
expert) 1,451 against 1,685. Qwen3-30B-A3B's (128 of 768, 8 picks) at 8,192 tokens, 512
slots an expert: 2,862 against 3,636.

Again on an H100 on 2026-12-06 (`moe_bench_h100_mixtral_small_24ef9a9.json`,
`moe_bench_h100_qwen3_large_24ef9a9.json`): Mixtral at 512 / 768 / 1,024 / 2,048 tokens
(128 / 192 / 256 / 512 slots an expert) 1,464 / 2,037 / 2,599 / 4,857 for the Triton
kernels against 1,690 / 1,451 / 2,066 / 3,339; Qwen3-30B-A3B at 16,384 and 32,768 tokens
(1,024 and 2,048 slots an expert) 5,391 / 10,693 against 6,910 / 13,481. So the run length
alone does not decide: large experts take the grouped GEMM from short runs, small ones
never did up to 2,048.

On an H200 at `a575044` (`moe_bench_h200_mid_shapes_a575044.json`), the sizes between:
OLMoE's (1,024 features) and DeepSeek-V2-Lite's (1,408) experts never took it at 512 to
8,192 tokens (up to 1,024 slots an expert); Phi-3.5-MoE's (6,400; 16 experts, 2 picks) at
512 / 1,024 / 2,048 / 8,192 tokens (64 / 128 / 256 / 1,024 slots an expert) 1,090 / 1,167
/ 2,012 / 7,879 for the Triton kernels against 1,029 / 1,468 / 1,915 / 5,616; Llama 4
Scout's (8,192; 16 experts, 1 pick) 1,264 / 1,752 / 1,897 / 7,030 against 1,533 / 1,529 /
2,155 / 4,757. So it runs from GROUPED_MIN_RUN slots an expert for experts of at least
GROUPED_MIN_INTERMEDIATE features (6,400 is the smallest measured to win; sizes between
1,408 and 6,400 are not measured, and keep the Triton kernels), for plain SwiGLU experts
in bfloat16 (no biases, no clamped or ungated activations, no quantized stacks) on Hopper
or newer GPUs.

Rounding points are the reference's (kernels/moe.py `moe_experts_ref`): each projection
rounds to the dtype, the gate's ops round, the expert's output times its float32 weight
rounds once, and a token's k terms sum in float32. No host reads: the run offsets are
computed on the device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from pdserve.kernels.expert_act import ExpertAct

GROUPED_MIN_RUN = 160  # mean slots an expert from which the grouped GEMM runs
GROUPED_MIN_INTERMEDIATE = 6400  # an expert's intermediate size from which it may


def grouped_applies(
    x: Tensor, w_gate_up: object, num_slots: int, b_gate_up: Tensor | None, act: ExpertAct
) -> bool:
    """Whether `moe_experts` takes the grouped GEMM for this call (module docstring)."""
    return (
        x.is_cuda
        and _sm90(x.device.index)
        and x.dtype == torch.bfloat16
        and isinstance(w_gate_up, Tensor)
        and b_gate_up is None
        and act.kind == "silu"
        and long_runs(num_slots, w_gate_up.shape[0], w_gate_up.shape[1] // 2)
    )


@functools.cache
def _sm90(device_index: int | None) -> bool:
    """Hopper or newer: where the grouped GEMM was measured (and CUTLASS's runs)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def grouped_device(device: str | torch.device) -> bool:
    """Whether this device runs the grouped GEMM for long runs (a Hopper or newer GPU)."""
    d = torch.device(device)
    return d.type == "cuda" and torch.cuda.is_available() and _sm90(d.index)


def long_runs(num_slots: int, num_experts: int, intermediate: int) -> bool:
    """At least GROUPED_MIN_RUN slots an expert, on average, through experts of at least
    GROUPED_MIN_INTERMEDIATE features."""
    return intermediate >= GROUPED_MIN_INTERMEDIATE and num_slots >= GROUPED_MIN_RUN * num_experts


def moe_experts_grouped(x: Tensor, w_gate_up: Tensor, w_down: Tensor, ids: Tensor,
                        weights: Tensor) -> Tensor:  # fmt: skip
    """`moe_experts_ref` (SwiGLU, no biases) as two grouped GEMMs over the slots sorted by
    expert: [T, H] -> [T, H]."""
    num_tokens, top_k = ids.shape
    num_experts, _, hidden = w_gate_up.shape
    inter = w_down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots by expert, in slot order within one
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host read (bincount sizes on it)
    ends = counts.cumsum(0).to(torch.int32)  # each expert's run ends here
    gate_up = F.grouped_mm(x[order // top_k], w_gate_up.transpose(1, 2), offs=ends)
    h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = F.grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    terms = torch.empty_like(y)
    terms[order] = (y.float() * weights.reshape(-1)[order, None].float()).to(x.dtype)
    return terms.view(num_tokens, top_k, hidden).sum(dim=1)
