"""GPTQ, AWQ and compressed-tensors "pack-quantized" checkpoints: integer weights packed
into int32 words, dequantized to the model's dtype as they load (as
runner/models/fp8_weights.py does for FP8).

Each stores, for a quantized linear `<prefix>` with K inputs and N outputs, the b-bit
codes (32 / b to a word, lowest bits first), the groups' zero points and scales; a
weight is `(code - zero) * scale` of its input's group. They differ in names and in what
is packed along which axis:
- GPTQ (AutoGPTQ, GPTQModel): `qweight` is [K * b / 32, N], packed along K; `qzeros`
  [groups, N * b / 32]; `g_idx` [K] names each input's group (act-order checkpoints
  permute them; without act-order it is k // group_size). Checkpoints in the original
  format ("gptq", v1) store each zero point minus one; "gptq_v2" stores it as is.
  2, 4 and 8 bits (3-bit words straddle int32 boundaries and are not read).
- AWQ (AutoAWQ, "gemm" version): `qweight` is [K, N * b / 32], packed along N with the
  eight nibbles of a word holding outputs 0, 2, 4, 6, 1, 3, 5, 7 of its eight; `qzeros`
  likewise; `scales` [groups, N]; groups are contiguous. 4 bits only; the "gemv" layouts
  are not read.
- compressed-tensors pack-quantized (llm-compressor's W4A16 / W8A16 exports):
  `weight_packed` is [N, ceil(K * b / 32)], packed along K (the last word padded);
  `weight_scale` [N, groups]; `weight_shape` [N, K]; symmetric codes are centred on
  2^(b-1), asymmetric ones have `weight_zero_point` [ceil(N * b / 32), groups], packed
  along N; `weight_g_idx` [K] for act-order. Activation quantization, if the config
  names one, is not applied: activations stay in the model's dtype (as for FP8).

Each linear is either dequantized (`dequantize_packed`: its weight in the model's dtype,
four times 4-bit's memory in bf16, the matmuls as for any 16-bit model; the execution
path says `weights=gptq->bfloat16`) or, where runner/models/packed_linear.py keeps it
packed, converted to kernels/int_linear.py's layout (`repacked`; `weights=gptq->int4`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kernels.int_linear import unpack_int32

PACKED_METHODS = ("gptq", "awq")  # and compressed-tensors with packed integer weights
CT = "compressed-tensors"
# vLLM's names for the same checkpoints run by its Marlin kernels (`--quantization
# gptq_marlin`): the same weights, so they select the same load here.
METHOD_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
# AWQ's nibble i of a word holds output _AWQ_ORDER[i] of the word's eight.
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
# compressed-tensors' parts (zero points: asymmetric only; g_idx: act-order only)
_CT_PARTS = ("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx", "weight_shape")


@dataclass(frozen=True)
class PackedIntFormat:
    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int
    group_size: int  # inputs a scale covers; -1: all of them (one group)
    zero_offset: int  # added to a stored zero point: 1 for GPTQ v1 checkpoints, else 0
    act_order: bool  # GPTQ's desc_act: g_idx is required, not k // group_size
    symmetric: bool = False  # compressed-tensors: no zero points stored, codes centred

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensor name suffixes of one quantized linear (GPTQ's g_idx and
        compressed-tensors' weight_g_idx optional unless act-order)."""
        if self.method != CT:
            return _PARTS[self.method]
        skip = {"weight_zero_point"} if self.symmetric else set()
        if not self.act_order:
            skip.add("weight_g_idx")
        return tuple(p for p in _CT_PARTS if p not in skip)

    @property
    def optional(self) -> str | None:
        """The part a linear may lack (its groups then contiguous), None if none may."""
        if self.act_order:
            return None
        return "weight_g_idx" if self.method == CT else "g_idx" if self.method == "gptq" else None


def quantization_config(hf_config: Any) -> dict | None:
    """The config's `quantization_config` as a dict, None where it has none."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    return quant


def _ct_int_weights(quant: dict) -> list[dict] | None:
    """A compressed-tensors config's weight specs when every group stores packed integer
    weights, else None (FP8 and other formats are not this module's)."""
    groups = list((quant.get("config_groups") or {}).values())
    packed = [quant.get("format") == "pack-quantized" or g.get("format") == "pack-quantized"
              for g in groups]  # fmt: skip
    weights = [g.get("weights") or {} for g in groups]
    if not groups or not all(packed) or any(w.get("type") != "int" for w in weights):
        return None
    return weights


def _ct_format(weights: list[dict]) -> PackedIntFormat:
    keys = {(w.get("num_bits"), bool(w.get("symmetric", True)), w.get("strategy"),
             w.get("group_size"), w.get("actorder") is not None) for w in weights}  # fmt: skip
    if len(keys) != 1:
        raise ValueError("compressed-tensors with differently quantized groups (mrv2 reads "
                         "one packed integer scheme a checkpoint)")  # fmt: skip
    ((bits, symmetric, strategy, group, act_order),) = keys
    if bits not in (2, 4, 8) or strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors pack-quantized {bits}-bit by {strategy} (mrv2 "
                         "reads 2, 4 and 8 bits by group or channel)")  # fmt: skip
    size = int(group) if strategy == "group" else -1
    return PackedIntFormat(CT, int(bits), size, 0, act_order, symmetric)


def packed_int_format(hf_config: Any) -> PackedIntFormat | None:
    """The config's GPTQ / AWQ / compressed-tensors packed integer layout, None for any
    other checkpoint. Raises ValueError for a variant that is not read (the caller lists
    it as unsupported)."""
    quant = quantization_config(hf_config)
    method = (quant or {}).get("quant_method")
    if method == CT:
        weights = _ct_int_weights(quant)
        return None if weights is None else _ct_format(weights)
    if method not in PACKED_METHODS:
        return None
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if method == "gptq":
        if bits not in (2, 4, 8):
            raise ValueError(f"gptq with {bits}-bit weights (mrv2 reads 2, 4 and 8 bits)")
        fmt = quant.get("checkpoint_format", quant.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} (mrv2 reads gptq and gptq_v2)")
        offset = 1 if fmt == "gptq" else 0
        return PackedIntFormat("gptq", bits, group, offset, bool(quant.get("desc_act")))
    version = str(quant.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(
            f"awq {version} with {bits}-bit weights (mrv2 reads 4-bit awq gemm checkpoints)"
        )
    if not quant.get("zero_point", True):
        raise ValueError("awq without zero points (mrv2 reads awq gemm with zero points)")
    return PackedIntFormat("awq", 4, group, 0, False)


def packed_source(hf_config: Any) -> str | None:
    """How the execution path names a packed checkpoint's weights: "gptq", "awq", or
    llm-compressor's "w4a16" / "w8a16" for compressed-tensors; None for any other."""
    quant = quantization_config(hf_config)
    method = (quant or {}).get("quant_method")
    if method in PACKED_METHODS:
        return method
    weights = _ct_int_weights(quant) if method == CT else None
    return f"w{weights[0].get('num_bits')}a16" if weights else None


def _awq_natural_columns(n: int) -> torch.Tensor:
    """Index that puts AWQ's unpacked columns in output order: output 8j + m sits at
    unpacked column 8j + i where _AWQ_ORDER[i] == m."""
    where = [_AWQ_ORDER.index(m) for m in range(8)]
    return (torch.arange(n).view(-1, 8)[:, where]).reshape(-1)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def dequantize_packed(
    parts: dict[str, torch.Tensor], fmt: PackedIntFormat, name: str = "?"
) -> torch.Tensor:
    """float32 [N, K] weight of one quantized linear from its checkpoint parts (GPTQ's
    `qweight`, `qzeros`, `scales`, `g_idx`; AWQ's and compressed-tensors' own). `name` only
    labels errors."""
    codes, zeros, scales, g_idx = unpacked(parts, fmt, name)
    weight = (codes - zeros[g_idx]).float() * scales[g_idx]  # [K, N]
    return weight.t().contiguous()


def repacked(
    parts: dict[str, torch.Tensor], fmt: PackedIntFormat, name: str = "?"
) -> dict[str, torch.Tensor]:
    """One linear's parts in kernels/int_linear.py's layout: `qweight` int32 [N, words]
    (its codes along K, lowest bits first, the last word zero-padded), `scales` float32
    and `zeros` uint8 [N, G]. Contiguous groups only (not act-order)."""
    codes, zeros, scales, g_idx = unpacked(parts, fmt, name)
    k, n = codes.shape
    size = k if fmt.group_size == -1 else fmt.group_size
    _check(bool((g_idx == torch.arange(k) // size).all()),
           f"{name}: g_idx is not k // {size}; act-order checkpoints are dequantized")  # fmt: skip
    per_word = 32 // fmt.bits
    padded = torch.nn.functional.pad(codes.t(), (0, -k % per_word))  # [N, words * p]
    fields = padded.reshape(n, -1, per_word) << torch.arange(0, 32, fmt.bits)
    words = fields.sum(-1)  # disjoint bit fields: the sum is their OR
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    _check(int(zeros.max()) < 256 and int(zeros.min()) >= 0, f"{name}: zero points past a byte")
    return {"qweight": words, "scales": scales.t().contiguous(),
            "zeros": zeros.t().contiguous().to(torch.uint8)}  # fmt: skip


def unpacked(parts: dict[str, torch.Tensor], fmt: PackedIntFormat, name: str = "?"):
    """(codes [K, N] int64, zeros [G, N] int64, scales [G, N] float32, g_idx [K] int64)
    of one quantized linear, shapes checked."""
    if fmt.method == CT:
        return _unpacked_ct(parts, fmt, name)
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    per_word = 32 // fmt.bits
    if fmt.method == "gptq":
        codes = unpack_int32(qweight, fmt.bits, dim=0)  # [K, N]
        zeros = unpack_int32(qzeros, fmt.bits, dim=1) + fmt.zero_offset  # [G, N]
    else:
        _check(qweight.shape[1] * per_word % 8 == 0, f"{name}: awq outputs not a multiple of 8")
        natural = _awq_natural_columns(qweight.shape[1] * per_word)
        codes = unpack_int32(qweight, fmt.bits, dim=1)[:, natural]
        zeros = unpack_int32(qzeros, fmt.bits, dim=1)[:, natural]
    return _grouped(codes, zeros, scales, parts.get("g_idx"), fmt, name)


def _unpacked_ct(parts: dict[str, torch.Tensor], fmt: PackedIntFormat, name: str):
    """compressed-tensors' parts, turned to GPTQ's orientation ([K, N] codes, [G, N]
    zeros and scales) for the shared tail."""
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    codes = unpack_int32(parts["weight_packed"], fmt.bits, dim=1)
    _check(codes.shape[0] == n and codes.shape[1] >= k,
           f"{name}: weight_packed {tuple(parts['weight_packed'].shape)} for a weight of "
           f"shape {(n, k)}")  # fmt: skip
    scales = parts["weight_scale"].float()
    if fmt.symmetric:
        zeros = torch.full_like(scales, 1 << (fmt.bits - 1), dtype=torch.int64)
    else:
        zeros = unpack_int32(parts["weight_zero_point"], fmt.bits, dim=0)[:n]
    g_idx = parts.get("weight_g_idx")
    return _grouped(codes[:, :k].t(), zeros.t(), scales.t(), g_idx, fmt, name)


def _grouped(codes, zeros, scales, g_idx, fmt: PackedIntFormat, name: str):
    """`unpacked`'s tuple from [K, N] codes and [G, N] zeros and scales, input k in group
    g_idx[k] (default k // group_size), the shapes and groups checked."""
    k, n = codes.shape
    groups = scales.shape[0]
    _check(
        tuple(scales.shape) == (groups, n) and tuple(zeros.shape) == (groups, n),
        f"{name}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} for a "
        f"{fmt.method} weight of {k} inputs and {n} outputs (both should be [groups, {n}])",
    )
    if g_idx is None:
        size = k if fmt.group_size == -1 else fmt.group_size
        _check(groups == -(-k // size), f"{name}: {groups} scale groups for {k} inputs "
               f"in groups of {size}")  # fmt: skip
        g_idx = torch.arange(k) // size
    else:
        g_idx = g_idx.to(torch.int64)
        _check(
            tuple(g_idx.shape) == (k,) and bool(((g_idx >= 0) & (g_idx < groups)).all()),
            f"{name}: g_idx of shape {tuple(g_idx.shape)} naming groups outside 0..{groups - 1}"
            f" for {k} inputs",
        )
    return codes, zeros, scales, g_idx


def dequantized_packed_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    fmt: PackedIntFormat,
    dtype: torch.dtype,
    keep_packed: Callable[[str], bool] = lambda prefix: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every packed linear's parts replaced by
    `<prefix>.weight` in `dtype`, or, where `keep_packed(prefix)`, by `repacked`'s
    `<prefix>.qweight`, `.scales` and `.zeros` (runner/models/packed_linear.py). A linear's parts may come in any order and from different
    shards: they wait until the last arrives. A GPTQ linear without `g_idx` takes
    k // group_size at the end of the stream, unless the checkpoint is act-order. Parts
    left over raise ValueError naming the linear and what it lacks."""
    wanted = fmt.parts
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in wanted:
            yield name, tensor
            continue
        parts = waiting.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == len(wanted):
            del waiting[prefix]
            yield from _converted(prefix, parts, fmt, dtype, keep_packed(prefix))
    missing = {p: [w for w in wanted if w not in parts] for p, parts in waiting.items()}
    for prefix in sorted(missing):
        if missing[prefix] == [fmt.optional]:
            yield from _converted(prefix, waiting[prefix], fmt, dtype, keep_packed(prefix))
            del missing[prefix]
    if missing:
        lone = [f"{p} (no {', '.join(m)})" for p, m in sorted(missing.items())[:2]]
        raise ValueError(f"{fmt.method} checkpoint has linears missing parts, e.g. {lone}")


def _converted(prefix: str, parts, fmt: PackedIntFormat, dtype: torch.dtype, keep: bool):
    if keep:
        for part, tensor in repacked(parts, fmt, prefix).items():
            yield f"{prefix}.{part}", tensor
    else:
        yield f"{prefix}.weight", dequantize_packed(parts, fmt, prefix).to(dtype)
