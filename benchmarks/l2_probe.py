"""Would the second half of a decode layer be faster if its weights were already in L2?

Not a test. The question behind it: in a 32-row decode layer (small_batch) the decode
attention reads K/V at ~2.7 TB/s on average (its start and tail leave HBM idle), and then
the o, gate/up (SiLU-and-mul) and down projections (skinny_linear, 23 MB of weights) take
~18 us for bytes that stream in ~5.4 us. If the attention's launch also issued L2
prefetches of those weights, the spare HBM time would fill them and the linears would read
L2. This probe measures that chain with a stand-in for the attention:

- `stream`: 256 programs (one per row and kv head at 32 rows) each reading its 152 KB of a
  per-layer 39 MB buffer (384 tokens of K/V at 32 rows), optionally with `evict_first`;
- `+pf<P>`: P more programs in the same launch that issue `prefetch.global.L2::evict_last`
  (or plain loads, `load`) for the layer's o, gate/up and down weights;
- then the three skinny linears of that layer; 28 layers with distinct buffers in one CUDA
  graph, replayed; reported per layer.

`hot` reuses layer 0's weights in every layer: the linears' time once the weights are in
L2, the most a prefetch could give. Two more groups of cases:

- `--cases stream`: the 39 MB stream alone at 128-2,048 programs of 2-8 warps (how fast
  the attention's bytes can stream at all);
- `--cases kv`: the other way round, the layer's K/V prefetched into L2 by a separate
  launch (`kv pf then stream`), or the next layer's K/V prefetched on a side stream of the
  graph beside this layer's linears (`chain kv pf side`).

Measured on the H200: results/l2_probe_3a8d70c.json (what each case says is there).

    python benchmarks/l2_probe.py [--cases weights,kv,stream] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import git_commit  # noqa: E402
from skinny_bench import graph_us  # noqa: E402

from pdserve.kernels import skinny_linear as sl  # noqa: E402
from pdserve.kernels.workspace import KernelWorkspace  # noqa: E402

LAYERS, ROWS, HIDDEN, INTER, Q_DIM = 28, 32, 1024, 3072, 2048
STREAM_PROGRAMS, KV_BYTES = 256, 32 * 384 * 8 * 128 * 2 * 2
O_N, GU_N, DOWN_N = HIDDEN * Q_DIM, 2 * INTER * HIDDEN, HIDDEN * INTER  # elements
LINE = 64  # bf16 elements in a 128-byte line


@triton.jit
def _prefetch_line(ptrs, POLICY: tl.constexpr):
    if POLICY == "evict_last":
        return tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _stream_kernel(
    kv_ptr, out_ptr, w_ptr, per_prog, w_lines, lines_per_pf,
    PF: tl.constexpr, PF_MODE: tl.constexpr, KV_POLICY: tl.constexpr, BLOCK: tl.constexpr,
    LINES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < PF:  # the prefetch programs come first: they are placed before the stream
        first = pid * lines_per_pf
        hit = tl.zeros([LINES], tl.int32)
        for i in range(0, lines_per_pf, LINES):
            line = first + i + tl.arange(0, LINES)
            ok = (line < w_lines) & (i + tl.arange(0, LINES) < lines_per_pf)
            ptrs = w_ptr + line.to(tl.int64) * 64
            if PF_MODE == "load":
                v = tl.load(ptrs, mask=ok, other=0.0, eviction_policy="evict_last")
                hit += (v != 0).to(tl.int32)
            else:
                hit += _prefetch_line(tl.where(ok, ptrs, w_ptr), PF_MODE)
        tl.store(out_ptr + 4096 + pid, tl.sum(hit))
    else:
        s = pid - PF
        base = kv_ptr + s.to(tl.int64) * per_prog
        acc = tl.zeros([BLOCK], tl.float32)
        for i in tl.range(0, per_prog, BLOCK, num_stages=4):
            acc += tl.load(base + i + tl.arange(0, BLOCK), eviction_policy=KV_POLICY).to(tl.float32)
        tl.store(out_ptr + s, tl.sum(acc))


@triton.jit
def _prefetch_kernel(ptr, lines, lines_per_pf, out_ptr, LINES: tl.constexpr, POLICY: tl.constexpr):
    """Each program issues `prefetch.global.L2` for its share of `lines` 128-byte lines."""
    pid = tl.program_id(0)
    first = pid * lines_per_pf
    hit = tl.zeros([LINES], tl.int32)
    for i in range(0, lines_per_pf, LINES):
        line = first + i + tl.arange(0, LINES)
        ok = (line < lines) & (i + tl.arange(0, LINES) < lines_per_pf)
        hit += _prefetch_line(tl.where(ok, ptr + line.to(tl.int64) * 64, ptr), POLICY)
    tl.store(out_ptr + pid, tl.sum(hit))


def per_layer_us(fn) -> float:
    """One CUDA graph of `fn` (all layers), replayed: us per layer."""
    return graph_us([fn], reps=30) / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument(
        "--cases",
        default="weights,kv",
        help="weights (L2 prefetch of the linears' weights), kv (of the next layer's K/V)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    per_layer = O_N + GU_N + DOWN_N
    weights = [
        torch.randn(per_layer, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        for _ in range(LAYERS)
    ]
    kv_elems = KV_BYTES // 2
    kvs = [torch.randn(kv_elems, device=dev, dtype=torch.bfloat16, generator=g)
           for _ in range(LAYERS)]  # fmt: skip
    out = torch.zeros(8192, device=dev, dtype=torch.float32)
    x = torch.randn(ROWS, Q_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    ws = KernelWorkspace()

    def views(w):
        o = w[:O_N].view(HIDDEN, Q_DIM)
        gu = w[O_N : O_N + GU_N].view(2 * INTER, HIDDEN)
        down = w[O_N + GU_N :].view(HIDDEN, INTER)
        return o, gu, down

    def linears(w):
        o, gu, down = views(w)
        h = sl.skinny_linear_triton(x, o, None, ws)
        a = sl.skinny_linear_triton(h, gu, None, ws, silu_mul_output=True)
        return sl.skinny_linear_triton(a, down, None, ws)

    def stream(layer, pf, mode, kv_policy, programs=STREAM_PROGRAMS, warps=2):
        lines = per_layer // LINE
        lines_per_pf = triton.cdiv(lines, pf) if pf else 0
        _stream_kernel[(programs + pf,)](
            kvs[layer], out, weights[layer], kv_elems // programs, lines, lines_per_pf,
            PF=pf, PF_MODE=mode, KV_POLICY=kv_policy, BLOCK=2048, LINES=512, num_warps=warps,
        )  # fmt: skip

    def case(pf=0, mode="evict_last", kv_policy="", lin="cold", with_stream=True):
        def fn():
            for layer in range(LAYERS):
                if with_stream:
                    stream(layer, pf, mode, kv_policy)
                if lin != "none":
                    linears(weights[0 if lin == "hot" else layer])

        return round(per_layer_us(fn), 2)

    side = torch.cuda.Stream()

    def prefetch_kv(layer, programs, fraction, policy):
        lines = int(kv_elems * fraction) // LINE
        _prefetch_kernel[(programs,)](
            kvs[layer], lines, triton.cdiv(lines, programs), out, LINES=512, POLICY=policy,
            num_warps=4,
        )  # fmt: skip

    def kv_case(mode, programs=132, fraction=1.0, policy="normal"):
        def fn():
            main = torch.cuda.current_stream()
            for layer in range(LAYERS):
                if mode == "pf then stream":
                    prefetch_kv(layer, programs, fraction, policy)
                    stream(layer, 0, "normal", "")
                elif mode == "pf only":
                    prefetch_kv(layer, programs, fraction, policy)
                else:  # the chain, next layer's K/V prefetched beside this layer's linears
                    stream(layer, 0, "normal", "")
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefetch_kv((layer + 1) % LAYERS, programs, fraction, policy)
                    linears(weights[layer])
                    main.wait_stream(side)

        return round(per_layer_us(fn), 2)

    rows = []

    def run_kv(name, **kw):
        rows.append({"case": name, **kw, "us_per_layer": kv_case(**kw)})
        print(json.dumps(rows[-1]), flush=True)

    def run(name, **kw):
        rows.append({"case": name, **kw, "us_per_layer": case(**kw)})
        print(json.dumps(rows[-1]), flush=True)

    if "weights" in args.cases:
        run("linears cold", with_stream=False)
        run("linears hot", with_stream=False, lin="hot")
        run("stream", lin="none")
        run("stream evict_first", lin="none", kv_policy="evict_first")
        run("chain cold")
        run("chain hot", lin="hot")
        for pf in (16, 64, 132):
            run(f"stream+pf{pf}", pf=pf, lin="none", kv_policy="evict_first")
            run(f"chain pf{pf}", pf=pf, kv_policy="evict_first")
        for mode in ("normal", "load"):
            run(f"stream+pf64 {mode}", pf=64, mode=mode, lin="none", kv_policy="evict_first")
            run(f"chain pf64 {mode}", pf=64, mode=mode, kv_policy="evict_first")
        run("chain pf64 kv normal", pf=64)
    if "stream" in args.cases:  # how fast can 39 MB stream at all (the attention's bytes)

        def stream_case(programs, warps):
            def fn():
                for layer in range(LAYERS):
                    stream(layer, 0, "normal", "", programs, warps)

            return round(per_layer_us(fn), 2)

        for programs in (128, 256, 512, 1024, 2048):
            for warps in (2, 4, 8):
                us = stream_case(programs, warps)
                rows.append({"case": "stream", "programs": programs, "warps": warps,
                             "us_per_layer": us})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    if "kv" in args.cases:
        run("stream", lin="none")
        run("chain cold")
        for programs in (32, 132, 264):
            run_kv("kv pf only", mode="pf only", programs=programs)
            run_kv("kv pf then stream", mode="pf then stream", programs=programs)
        run_kv("kv pf half only", mode="pf only", fraction=0.5)
        run_kv("kv pf half then stream", mode="pf then stream", fraction=0.5)
        for programs in (16, 66, 132):
            run_kv("chain kv pf side", mode="side", programs=programs)
            run_kv("chain kv pf half side", mode="side", programs=programs, fraction=0.5)
        run_kv("chain kv pf side evict_last", mode="side", policy="evict_last")
        run_kv("kv pf evict_last then stream", mode="pf then stream", policy="evict_last")

    doc = {"device": torch.cuda.get_device_name(), "commit": git_commit(),
           "command": " ".join(["benchmarks/l2_probe.py", *sys.argv[1:]]), "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / f"l2_probe_{doc['commit']}.json", "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
