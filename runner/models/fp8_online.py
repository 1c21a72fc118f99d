"""vLLM's `--quantization fp8` on a 16-bit checkpoint: the Llama-family projections (and
the routed experts of its MoE layers) are quantized to float8_e4m3fn as they load, one
scale an output channel (`amax / 448`, kernels/fp8_quant.py's rounding), and then run
exactly as an FP8 checkpoint's kept bytes do (runner/models/fp8_kept.py): as W8A8 FP8
GEMMs in bf16 models (kernels/fp8_gemm.py, activations quantized per token), through
kernels/int_linear.py's weight-only FP8 tiles in others. Half the weight memory of bf16.

What is not quantized, as in vLLM: embeddings, the LM head, norms, routers, and every
family whose projections do not run packed (runner/models/packed_linear.py
`swap_packed_linears`; those are refused by name rather than silently left 16-bit).
The weights stream through the device when there is one (one tensor at a time), so the
quantization runs as a Triton kernel there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from pdserve.kernels.fp8_quant import quantize_fp8
from pdserve.runner.models.fp8_kept import FP8_KEPT
from pdserve.runner.models.fp8_weights import Fp8Format
from pdserve.runner.models.packed_int_weights import PackedIntFormat

if TYPE_CHECKING:
    from pdserve.runner.config import ModelConfig

# the kept-FP8 description of the quantized projections: 8-bit float codes, a scale a row
ONLINE_FORMAT = PackedIntFormat(FP8_KEPT, 8, -1, 0, act_order=False, symmetric=True)
# how the quantized stream names its scales (dequantized_weights reads it as a
# compressed-tensors FP8 checkpoint with a scale per channel)
ONLINE_FP8_FORMAT = Fp8Format("compressed-tensors", "_scale", None)


def quantized_at_load(
    weights: Iterable[tuple[str, torch.Tensor]],
    keep: Callable[[str], bool],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every 2-D `<prefix>.weight` where `keep(prefix)`
    replaced by its FP8 codes and a `<prefix>.weight_scale` (ONLINE_FP8_FORMAT's names),
    quantized on `device`; the rest as they come."""
    for name, tensor in weights:
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and tensor.dim() == 2 and keep(prefix):
            codes, scale = quantize_fp8(tensor.to(device).contiguous())  # [N, K], [N, 1]
            yield name, codes
            yield f"{name}{ONLINE_FP8_FORMAT.scale_suffix}", scale
        else:
            yield name, tensor


def online_swap(model: torch.nn.Module, model_config: ModelConfig, fold: bool) -> set[str]:
    """Swaps in the kept-FP8 PackedLinears (and experts) that the quantized weights load
    into; refuses by name what cannot run so (`fold=False`: LoRA adapters, which read
    16-bit weights) rather than leave the model silently 16-bit."""
    from pdserve.runner.models.packed_linear import packed_refusal, swap_packed_linears

    if model_config.quantized_weights == "dequantized":
        raise ValueError(
            "quantization='fp8' quantizes the weights at load and quantized_weights="
            "'dequantized' asks for 16-bit ones: drop one of the two"
        )
    why = packed_refusal(ONLINE_FORMAT, lora=not fold)
    if why is not None:
        raise ValueError(f"quantization='fp8' on a 16-bit checkpoint: {why}")
    swapped = swap_packed_linears(model, ONLINE_FORMAT)
    if not swapped:
        raise ValueError(
            f"quantization='fp8': {model_config.architecture}'s projections do not run on "
            "FP8 weights here (Llama-family decoders without reworked weights do); drop it "
            "to serve the 16-bit weights"
        )
    return swapped


def source_dtype(hf_config) -> str:
    """The checkpoint's own dtype as the execution path names it ("bfloat16->...")."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return name if name in ("bfloat16", "float16", "float32") else "16-bit"
