"""Benchmark of FP8 GEMMs (torch._scaled_mm, W8A8: activations quantized per token or per
128-input group as they arrive) against cuBLAS bf16 and the kept-FP8 long-batch path
(the weight dequantized to bf16, then cuBLAS); writes JSON.

Not a test. Llama-3-8B's four decoder GEMMs, or `--shapes qwen3_0_6b`, at decode and
prefill row counts. Each case is a CUDA graph of `--layers` calls on as many distinct
weights (none read from L2), replayed; reported per call in us. Impls:
- cublas_bf16: F.linear on bf16 weights.
- fp8_dequant_cublas: kernels/int_linear.py's long-batch path on kept FP8 bytes;
  fp8_int_linear (up to 128 rows): its decode path (the weight-only Triton tiles).
- w8a8_rowwise / w8a8_block: the activation quantization (torch ops: kernels/fp8_quant.py's
  spec for rows) and _scaled_mm with
  a scale per output channel / per 128 x 128 weight block; `_gemm` rows time the
  _scaled_mm alone on pre-quantized activations.
Each W8A8 result is compared with F.linear in fp32 on the dequantized operands
(`max_rel_err`: the largest error over the output's largest magnitude).

    python benchmarks/fp8_gemm_bench.py [--rows 1,32,256,2048,8192] [--shapes llama3_8b]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from int_linear_bench import SHAPES
from run_meta import write_result
from skinny_bench import graph_us

from pdserve.kernels.fp8_quant import quantize_fp8, quantize_fp8_ref
from pdserve.kernels.int_linear import DEQUANT_ROWS, dequantize_int_triton, int_linear_triton
from pdserve.kernels.workspace import KernelWorkspace

FP8_MAX = 448.0
BLOCK = 128


def quant_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, 128 inputs) FP8: (codes [M, K], scale [M, K / 128] float32, M-major as
    cuBLAS's 1 x 128 recipe wants it)."""
    m, k = x.shape
    g = x.float().reshape(m, k // BLOCK, BLOCK)
    s = g.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(m, k)
    return q, s.t().contiguous().t()


def _scaled(q, w, s_a, s_b):
    return torch._scaled_mm(q, w, scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)


def bench_rows(base: dict, x: torch.Tensor, weights: tuple) -> list[dict]:
    """Every impl at one (GEMM, rows) case."""
    dense, row_scale, w8, blk, w8b, qweights = weights
    (m, k), n = x.shape, dense[0].shape[0]
    zeros = torch.zeros(n, 1, dtype=torch.uint8, device="cuda")
    rows_out = []

    def add(impl: str, calls, err: float | None = None) -> None:
        us = graph_us(calls)
        row = {**base, "impl": impl, "us": round(us, 2)}
        if err is not None:
            row["max_rel_err"] = round(err, 5)
        rows_out.append(row)
        print(row, flush=True)

    add("cublas_bf16", [lambda w=w: F.linear(x, w) for w in dense])
    add("fp8_dequant_cublas", [lambda q=q, s=s: F.linear(x, dequantize_int_triton(
        q, s, zeros, 8, k, k, x.dtype, True)) for q, s in zip(qweights, row_scale)])  # fmt: skip
    if m <= DEQUANT_ROWS:  # the kept-FP8 decode path (16-bit activations)
        work = KernelWorkspace()
        add("fp8_int_linear", [lambda q=q, s=s: int_linear_triton(
            x, q, s, zeros, 8, k, None, None, work, True)
            for q, s in zip(qweights, row_scale)])  # fmt: skip

    def rowwise(w, s):
        q, xs = quantize_fp8_ref(x)
        return torch._scaled_mm(q, w.t(), scale_a=xs, scale_b=s.t(), out_dtype=torch.bfloat16)

    q, xs = quantize_fp8_ref(x)
    ref = F.linear(q.float() * xs, w8[0].float() * row_scale[0])
    got = rowwise(w8[0], row_scale[0]).float()
    add("w8a8_rowwise", [lambda w=w, s=s: rowwise(w, s) for w, s in zip(w8, row_scale)],
        ((got - ref).abs().max() / ref.abs().max()).item())  # fmt: skip
    add("w8a8_rowwise_gemm", [lambda w=w, s=s: torch._scaled_mm(
        q, w.t(), scale_a=xs, scale_b=s.t(), out_dtype=torch.bfloat16)
        for w, s in zip(w8, row_scale)])  # fmt: skip

    add("quant_rows_triton", [lambda: quantize_fp8(x) for _ in dense])
    tq, ts = quantize_fp8(x)
    tq_ref, ts_ref = quantize_fp8_ref(x.cpu())
    rows_out.append({**base, "impl": "quant_rows_triton_equals_spec",
                     "equal": torch.equal(tq.cpu().view(torch.uint8), tq_ref.view(torch.uint8))
                     and torch.equal(ts.cpu(), ts_ref)})  # fmt: skip

    def rowwise_tq(w, s):
        q, xs = quantize_fp8(x)
        return _scaled(q, w.t(), xs, s.t())

    add("w8a8_rowwise_triton_quant", [lambda w=w, s=s: rowwise_tq(w, s)
                                      for w, s in zip(w8, row_scale)])  # fmt: skip

    def blockwise(w, s, layout):
        qg, gs = quant_groups(x)
        return torch._scaled_mm(qg, w.t(), scale_a=gs, scale_b=layout(s),
                                out_dtype=torch.bfloat16)  # fmt: skip

    # which layout of the [N / 128, K / 128] weight scales cuBLAS reads as 128 x 128
    layouts = {"t": lambda s: s.t(), "t_contig": lambda s: s.t().contiguous(),
               "as_is": lambda s: s}  # fmt: skip
    qg, gs = quant_groups(x)
    wd = w8b[0].float() * blk[0].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    ref = F.linear((qg.float().reshape(m, -1, BLOCK) * gs[..., None]).reshape(m, k), wd)
    for label, layout in layouts.items():
        try:
            got = blockwise(w8b[0], blk[0], layout).float()
            add(f"w8a8_block_{label}", [lambda w=w, s=s, f=layout: blockwise(w, s, f)
                                        for w, s in zip(w8b, blk)],
                ((got - ref).abs().max() / ref.abs().max()).item())  # fmt: skip
            add(f"w8a8_block_{label}_gemm", [lambda w=w, s=s, f=layout: torch._scaled_mm(
                qg, w.t(), scale_a=gs, scale_b=f(s), out_dtype=torch.bfloat16)
                for w, s in zip(w8b, blk)])  # fmt: skip
        except Exception as e:  # a recipe this torch / cuBLAS does not take: reported
            rows_out.append({**base, "impl": f"w8a8_block_{label}", "error": str(e)[:300]})
            print(rows_out[-1], flush=True)
    return rows_out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="llama3_8b")
    ap.add_argument("--rows", default="1,32,128,256,2048,8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_gemm_bench: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES[args.shapes].items():
        dense = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
                 for _ in range(args.layers)]  # fmt: skip
        row_scale = [w.abs().amax(dim=1, keepdim=True).float() / FP8_MAX for w in dense]
        w8 = [(w.float() / s).to(torch.float8_e4m3fn) for w, s in zip(dense, row_scale)]
        blk = [w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK).abs().amax(dim=(1, 3))
               / FP8_MAX for w in dense]  # fmt: skip
        w8b = [(w.float() / s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1))
               .to(torch.float8_e4m3fn) for w, s in zip(dense, blk)]  # fmt: skip
        qweights = [q.view(torch.uint8).view(torch.int32) for q in w8]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            weights = (dense, row_scale, w8, blk, w8b, qweights)
            rows_out += bench_rows({"gemm": name, "n": n, "k": k, "rows": m}, x, weights)
        del dense, w8, w8b, qweights
        torch.cuda.empty_cache()
    write_result(args.out, f"fp8_gemm_bench_{args.shapes}", "benchmarks/fp8_gemm_bench.py",
                 sys.argv[1:], {"results": rows_out})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
