"""Do the Triton kernels compile for the H100/H200, without one? Runs the kernels' Python
launchers on CPU tensors of real shapes, catches each launch before it runs (the kernel,
its arguments, its constexprs, its warps and stages), and compiles it for sm_90 with the
Triton on the path. Not a test (no GPU runs anything); prints a JSON line a launch and
exits 1 if any fails to compile.

    PYTHONPATH=<triton 3.6 dir>:$PYTHONPATH python benchmarks/sm90_compile_check.py [--only NAME]

Why: Triton's interpreter (the CPU tests) accepts code the compiler refuses (a `return`
inside a constexpr `if` in a jitted helper passed every CPU test and failed on the first
GPU run), so kernels written without a GPU at hand get this check before their first
device call. Arguments are typed as the launcher would type them: tensors by dtype,
integers as i32 (i64 past 2^31), 1 specialised away, pointers and multiples of 16 marked
16-byte divisible. What it does not show: run-time faults or wrong results (the GPU tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.bool: "i1",
}  # fmt: skip


class Launch:
    def __init__(self, fn: JITFunction, args: tuple, kwargs: dict):
        self.fn = fn
        self.options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(fn.arg_names, args, strict=False)) | kwargs
        self.constexprs, self.signature, self.attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            value = bound.get(name, fn.params[i].default)
            if fn.params[i].is_constexpr or value is None:
                # a CUDA launch never upcasts its dots (the CPU interpreter's bf16 path does)
                self.constexprs[name] = False if name == "UPCAST_DOT" else value
                self.signature[name] = "constexpr"
            elif isinstance(value, torch.Tensor):
                self.signature[name] = "*" + DTYPES[value.dtype]
                self.attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, bool):
                self.signature[name] = "i1"
            elif isinstance(value, int):
                if value == 1 and not fn.params[i].do_not_specialize:
                    self.constexprs[name] = 1
                    self.signature[name] = "constexpr"
                    continue
                self.signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                if value % 16 == 0 and not fn.params[i].do_not_specialize:
                    self.attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                self.signature[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {name} = {value!r}")
        # IEEE_DOT is on for every CPU launch (the interpreter multiplies 16-bit tiles as raw
        # bits); on a GPU it is on only for float32 operands: off where any tensor is 16-bit
        if "IEEE_DOT" in self.constexprs:
            halves = {torch.bfloat16, torch.float16}
            if any(isinstance(v, torch.Tensor) and v.dtype in halves for v in bound.values()):
                self.constexprs["IEEE_DOT"] = False

    @property
    def name(self) -> str:
        shown = {k: v for k, v in self.constexprs.items() if k.isupper()}
        return f"{self.fn.__name__}{shown}"

    def compile(self):
        """The kernel compiled for sm_90 (its `asm["ptx"]`: sm90_same_code.py)."""
        src = ASTSource(fn=self.fn, signature=self.signature, constexprs=self.constexprs,
                        attrs=self.attrs)  # fmt: skip
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=self.options)


def capture(run: Callable[[], object]) -> tuple[list[Launch], str | None]:
    """The launches `run` makes, none of them run, and what stopped it early, if anything
    (a launcher reading a result that never came, or a CUDA-only call: the launches
    before it still count). Constexprs the launchers set by device are set as a CUDA
    launch sets them (Launch: UPCAST_DOT, IEEE_DOT)."""
    launches: list[Launch] = []
    original = JITFunction.run

    def caught(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = caught
    try:
        run()
        stopped = None
    except Exception as exc:  # noqa: BLE001 - reported beside the launches caught
        stopped = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        JITFunction.run = original
    return launches, stopped


# ---- scenarios: each calls public launchers at real sizes on CPU tensors -----------------


def selective_scan() -> None:
    from pdserve.kernels.selective_scan import selective_scan_triton

    d, n = 8192, 16
    for qs in (None, torch.tensor([0, 300, 301, 1000])):
        rows = 4 if qs is None else 3
        t = rows if qs is None else 1000
        f = dict(dtype=torch.float32)
        selective_scan_triton(
            torch.zeros(8, d, n), torch.arange(rows), torch.zeros(rows, dtype=torch.bool), qs,
            torch.zeros(t, d, **f), torch.zeros(t, d, **f), torch.zeros(d, n, **f),
            torch.zeros(t, n, **f), torch.zeros(t, n, **f), torch.zeros(d, **f),
        )  # fmt: skip


def state_updates() -> None:
    from pdserve.kernels.delta_rule_update import delta_rule_decode_triton
    from pdserve.kernels.ssm_update import ssm_decode_triton

    f = dict(dtype=torch.float32)
    r = 32
    ssm_decode_triton(
        torch.zeros(40, 48, 64, 128), torch.arange(r), torch.zeros(r, dtype=torch.bool),
        torch.zeros(r, 48, 64, **f), torch.zeros(r, 48, **f), torch.zeros(48, **f),
        torch.zeros(r, 1, 128, **f), torch.zeros(r, 1, 128, **f), torch.zeros(48, **f),
    )  # fmt: skip
    delta_rule_decode_triton(
        torch.zeros(40, 32, 128, 128), torch.arange(r), torch.zeros(r, dtype=torch.bool),
        torch.zeros(r, 32, 128, **f), torch.zeros(r, 32, 128, **f),
        torch.zeros(r, 32, 128, **f), torch.zeros(r, 32, **f), torch.zeros(r, 32, **f),
    )  # fmt: skip


def norms() -> None:
    from pdserve.kernels import norm

    bf = dict(dtype=torch.bfloat16)
    x, w = torch.zeros(4096, 8192, **bf), torch.zeros(8192, **bf)
    norm.rms_norm_triton(x, w, 1e-6)
    norm.fused_add_rms_norm_triton(x, x, w, 1e-6)
    norm.layer_norm_triton(x, w, 1e-5)  # Cohere's
    norm.fused_add_layer_norm_triton(x, x, w, 1e-5)
    qkv = torch.zeros(4096, (96 + 2 * 8) * 128, **bf)  # Command R+'s per-head q norms
    q = qkv[:, : 96 * 128].view(4096, 96, 128)
    norm.layer_norm_triton(q, torch.zeros(96, 128, **bf), 1e-5)


def attention(window: int) -> Callable[[], None]:
    def run() -> None:
        from pdserve.kernels import paged_attention_triton as pat
        from pdserve.kernels.paged_attention_triton import paged_attention_triton
        from pdserve.kernels.workspace import KernelWorkspace

        # The flat kernel's grid is one program an SM: on this CPU (1 "SM") no grid would
        # fit its pairs, so size it as an H100's 132 SMs do.
        pat._num_sms = lambda device: 132

        bs, hq, hkv, d = 16, 16, 8, 128
        cache = torch.zeros(64, 2, bs, hkv, d, dtype=torch.bfloat16)
        for rows in ([(300, 300), (40, 1)], [(500, 1)] * 32, [(500, 1)] * 300):
            ctx = torch.tensor([c for c, _ in rows], dtype=torch.int32)
            ql = torch.tensor([q for _, q in rows])
            qsl = torch.cat([torch.zeros(1, dtype=torch.int64), ql.cumsum(0)]).int()
            q = torch.zeros(int(qsl[-1]), hq, d, dtype=torch.bfloat16)
            tables = torch.zeros(len(rows), 40, dtype=torch.int32)
            for kernel in ("per_head", "packed", "flat"):
                paged_attention_triton(
                    q, cache, tables, qsl, ctx, d**-0.5, torch.empty_like(q), int(ql.max()),
                    int(ctx.max()), workspace=KernelWorkspace(), decode_kernel=kernel,
                    window=window,
                )  # fmt: skip

    return run


def moe(quant: str) -> Callable[[], None]:
    def run() -> None:
        from pdserve.kernels.expert_act import ExpertAct
        from pdserve.kernels.moe_triton import moe_experts_triton

        t, h, inter, e, k = 64, 2880, 2880, 32, 4
        x = torch.zeros(t, h, dtype=torch.bfloat16)
        ids = torch.randint(0, e, (t, k))
        w = torch.full((t, k), 0.25)
        if quant == "bf16":
            gu = torch.zeros(e, 2 * inter, h, dtype=torch.bfloat16)
            dn = torch.zeros(e, h, inter, dtype=torch.bfloat16)
        elif quant == "mxfp4":
            from pdserve.kernels.mxfp4 import Mxfp4Stack

            gu = Mxfp4Stack(torch.zeros(e, 2 * inter, h // 2, dtype=torch.uint8),
                            torch.zeros(e, 2 * inter, h // 32, dtype=torch.uint8))  # fmt: skip
            dn = Mxfp4Stack(torch.zeros(e, h, inter // 2, dtype=torch.uint8),
                            torch.zeros(e, h, inter // 32, dtype=torch.uint8))  # fmt: skip
        else:
            from pdserve.kernels.fp8_experts import Fp8Stack

            f8 = torch.float8_e4m3fn
            gu = Fp8Stack(torch.zeros(e, 2 * inter, h, dtype=f8),
                          torch.zeros(e, 2 * inter, -(-h // 128)), 128)  # fmt: skip
            dn = Fp8Stack(torch.zeros(e, h, inter, dtype=f8), torch.zeros(e, h, -(-inter // 128)),
                          128)  # fmt: skip
        moe_experts_triton(x, gu, dn, ids, w)
        # gpt-oss's call: biases and the clamped gate
        biases = dict(b_gate_up=torch.zeros(e, 2 * inter, dtype=torch.bfloat16),
                      b_down=torch.zeros(e, h, dtype=torch.bfloat16))  # fmt: skip
        moe_experts_triton(x, gu, dn, ids, w, act=ExpertAct("swiglu_oai", 1.702, 7.0), **biases)

    return run


def packed_int() -> Callable[[], None]:
    """int_linear (split and unsplit) and the packed experts at Qwen3-30B-A3B's sizes, in
    each tile form; fp16 for the scale-after form (the CPU launcher refuses it in bf16)."""

    def run() -> None:
        # (int_linear's tile forms first, the fields form last: a base tree without the newer
        # launchers still makes the launches before them, for sm90_same_code.py)
        from pdserve.kernels.int_linear import IntLinearConfig, choose_config, int_linear_triton
        from pdserve.kernels.workspace import KernelWorkspace

        h, inter, e, k, g = 2048, 768, 128, 8, 128
        q = torch.zeros(1024, h // 8, dtype=torch.int32)
        scales, zeros = torch.zeros(1024, h // g), torch.zeros(1024, h // g, dtype=torch.uint8)
        for fields in (False, True):
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.zeros(32, h, dtype=dtype)
                split = choose_config(32, 1024, g, h // g, h)
                unsplit = IntLinearConfig(32, 128)
                if fields:
                    split = dataclasses.replace(split, fields=True, block_k=128)
                    unsplit = dataclasses.replace(unsplit, fields=True)
                int_linear_triton(x, q, scales, zeros, 4, g, None, split, KernelWorkspace())
                int_linear_triton(x, q, scales, zeros, 4, g, None, unsplit)

        from pdserve.kernels.moe_int import (
            IntMoeTiles,
            PackedExperts,
            choose_int_tiles,
            moe_experts_int_triton,
        )

        def stack(n: int, kk: int) -> PackedExperts:
            return PackedExperts(torch.zeros(e, n, kk // 8, dtype=torch.int32),
                                 torch.zeros(e, n, kk // g), torch.zeros(e, n, kk // g,
                                 dtype=torch.uint8), 4, g, kk)  # fmt: skip

        gu, dn = stack(2 * inter, h), stack(h, inter)
        for t in (32, 512, 2048):  # blocks of 16, 32 and 64 slots
            ids = torch.randint(0, e, (t, k))
            w = torch.full((t, k), 0.125)
            tiles = choose_int_tiles(t * k, e)
            for dtype, form in ((torch.bfloat16, {}), (torch.bfloat16, {"words_once": False}),
                                (torch.float16, {"scale_after": True}),
                                (torch.bfloat16, {"fields": True, "block_k": 128}),
                                (torch.float16, {"fields": True, "block_k": 128,
                                                 "scale_after": True})):  # fmt: skip
                x = torch.zeros(t, h, dtype=dtype)
                moe_experts_int_triton(x, gu, dn, ids, w, IntMoeTiles(**{**vars(tiles), **form}))

    return run


def fp8_kept() -> None:
    """int_linear on an FP8 checkpoint's kept bytes (Qwen3-8B-FP8's o projection: blocks of
    128 inputs; and one scale a row), split and unsplit, plus the long-batch dequantize;
    and kept FP8 experts."""
    from pdserve.kernels.int_linear import (
        IntLinearConfig,
        choose_config,
        dequantize_int_triton,
        int_linear_triton,
    )
    from pdserve.kernels.workspace import KernelWorkspace

    n, k = 4096, 4096
    q = torch.zeros(n, k // 4, dtype=torch.int32)
    for g in (128, k):
        scales, zeros = torch.zeros(n, k // g), torch.zeros(n, k // g, dtype=torch.uint8)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.zeros(32, k, dtype=dtype)
            split = choose_config(32, n, g, k // g, k)
            int_linear_triton(x, q, scales, zeros, 8, g, None, split, KernelWorkspace(), fp8=True)
            int_linear_triton(x, q, scales, zeros, 8, g, None, IntLinearConfig(32, 128), fp8=True)
        dequantize_int_triton(q, scales, zeros, 8, k, g, torch.bfloat16, fp8=True)
    # Qwen3-30B-A3B-FP8's experts (blocks of 128 inputs), at decode and prefill blocks
    from pdserve.kernels.moe_int import PackedExperts, moe_experts_int_triton

    h, inter, e, top = 2048, 768, 128, 8

    def stack(rows: int, kk: int) -> PackedExperts:
        return PackedExperts(torch.zeros(e, rows, kk // 4, dtype=torch.int32),
                             torch.zeros(e, rows, kk // 128), torch.zeros(e, rows, kk // 128,
                             dtype=torch.uint8), 8, 128, kk, fp8=True)  # fmt: skip

    for t in (32, 2048):
        x = torch.zeros(t, h, dtype=torch.bfloat16)
        ids, w = torch.randint(0, e, (t, top)), torch.full((t, top), 0.125)
        moe_experts_int_triton(x, stack(2 * inter, h), stack(h, inter), ids, w)


def fp8_quant() -> None:
    """The W8A8 activation quantizer (kernels/fp8_quant.py): a scale a row in one pass
    (Llama-3-8B's K of 4096, and 8192) and in two (14336)."""
    from pdserve.kernels.fp8_quant import quantize_fp8_triton

    for k in (4096, 8192, 14336):
        for dtype in (torch.bfloat16, torch.float16):
            quantize_fp8_triton(torch.zeros(160, k, dtype=dtype))


def decode_small_batch() -> None:
    """The layer kernels of throughput.py's small_batch decode step (32 rows, Qwen3-0.6B's
    shapes, bf16, norms folded): prepare_qkv on scaled rows, the per-head decode attention,
    the o and down projections adding the residual, gate/up with SiLU on scaled rows; and
    the preparation inside the attention (per_head_prep)."""
    from pdserve.kernels.paged_attention_triton import paged_attention_triton
    from pdserve.kernels.qkv_attend import qkv_attend_triton
    from pdserve.kernels.qkv_prep import prepare_qkv_triton
    from pdserve.kernels.row_squares import ScaleRows
    from pdserve.kernels.skinny_linear import skinny_linear_add_residual, skinny_linear_triton
    from pdserve.kernels.workspace import KernelWorkspace

    r, hidden, inter, hq, hkv, d, bf = 32, 1024, 3072, 16, 8, 128, torch.bfloat16
    ws = KernelWorkspace()
    res = torch.zeros(r, hidden, dtype=bf)
    h, squares = skinny_linear_add_residual(torch.zeros(r, hq * d, dtype=bf),
                                            torch.zeros(hidden, hq * d, dtype=bf), None, res, ws)  # fmt: skip
    scale = ScaleRows(squares, 1e-6)
    gate = skinny_linear_triton(h, torch.zeros(2 * inter, hidden, dtype=bf), None, ws, True,
                                scale_rows=scale)  # fmt: skip
    skinny_linear_add_residual(gate, torch.zeros(hidden, inter, dtype=bf), None, h, ws)
    cache = torch.zeros(512, 2, 16, hkv, d, dtype=bf)
    q = prepare_qkv_triton(
        torch.zeros(r, (hq + 2 * hkv) * d, dtype=bf), hq, hkv, torch.ones(d, dtype=bf),
        torch.ones(d, dtype=bf), 1e-6, torch.arange(r), torch.zeros(4096, d), cache,
        torch.arange(r), scale_rows=scale,
    )  # fmt: skip
    seq = torch.full((r,), 384, dtype=torch.int32)
    qsl = torch.arange(r + 1, dtype=torch.int32)
    tables = torch.arange(r * 32, dtype=torch.int32).view(r, 32) % 512
    paged_attention_triton(q, cache, tables, qsl, seq, d**-0.5, torch.empty_like(q), 1, 4096,
                           workspace=ws)  # fmt: skip
    # --decode-attention per_head_prep: the two in one launch (kernels/qkv_attend.py)
    qkv_attend_triton(
        torch.zeros(r, (hq + 2 * hkv) * d, dtype=bf), hq, hkv, torch.ones(d, dtype=bf),
        torch.ones(d, dtype=bf), 1e-6, torch.arange(r), torch.zeros(4096, d), cache,
        torch.arange(r), tables, qsl, seq, d**-0.5, 4096, scale_rows=scale,
    )  # fmt: skip


def scenarios() -> dict[str, Callable[[], None]]:
    out = {
        "selective_scan": selective_scan,
        "state_updates": state_updates,
        "norms": norms,
        "attention_full": attention(0),
        "attention_sliding": attention(4096),
        "attention_chunked": attention(-8192),
        "moe_bf16": moe("bf16"),
        "packed_int": packed_int(),
        "fp8_kept": fp8_kept,
        "fp8_quant": fp8_quant,
        "decode_small_batch": decode_small_batch,
    }
    try:  # the quantized experts' stacks (branch exp/mxfp4-experts)
        import pdserve.kernels.fp8_experts  # noqa: F401
        import pdserve.kernels.mxfp4  # noqa: F401

        out |= {"moe_mxfp4": moe("mxfp4"), "moe_fp8": moe("fp8")}
    except ImportError:
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="one scenario by name")
    ap.add_argument("--resources", action="store_true",
                    help="also each launch's registers, spills, shared memory (sm90_resources)")  # fmt: skip
    args = ap.parse_args()
    failed, seen = 0, set()
    for name, run in scenarios().items():
        if args.only and name != args.only:
            continue
        launches, stopped = capture(run)
        if stopped:
            print(json.dumps({"scenario": name, "launcher_stopped": stopped}), flush=True)
        if not launches:
            print(json.dumps({"scenario": name, "error": "no launch caught"}), flush=True)
            failed += 1
        for launch in launches:
            key = (launch.fn, json.dumps(launch.signature), repr(launch.constexprs))
            if key in seen:
                continue
            seen.add(key)
            row = {"scenario": name, "kernel": launch.name, **launch.options}
            try:
                kernel = launch.compile()
                row["compiled"] = True
                if args.resources:
                    from sm90_resources import resources

                    row |= resources(kernel)
            except Exception as exc:  # noqa: BLE001 - reported, and counted
                row["compiled"], row["error"] = False, f"{type(exc).__name__}: {exc}"[:2000]
                failed += 1
            print(json.dumps(row), flush=True)
    print(json.dumps({"triton": triton.__version__, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
