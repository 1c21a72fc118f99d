"""What the H200 would run, without an H200: compile the decode-path Triton kernels for sm_90
on this machine and report each one's registers, spill stack, shared memory and software
pipeline (async copies, buffers per loaded tile). Not a test; prints JSON lines.

    python benchmarks/sm90_resources.py [--out results.json]

Triton compiles for a GPU target without a GPU (its bundled ptxas; `cuobjdump` reads the
cubin's resource usage). Run it under the Triton the GPU image has (3.6 on the H200 image;
`pip install --target DIR triton==3.6.0` and put DIR first on PYTHONPATH): another Triton
pipelines differently. Pointer and stride arguments are marked 16-byte divisible, as the
launcher marks them at run time: without that hint loads are not vectorised and nothing
is pipelined, so the report would describe a kernel that never runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pdserve.kernels import paged_decode_split as pds
from pdserve.kernels import skinny_linear as sl

INT_PTRS = {"bt_ptr", "qsl_ptr", "seq_lens_ptr", "count_ptr"}
F32_PTRS = {"part_o_ptr", "part_lse_ptr", "part_ptr", "sq_in_ptr", "sq_out_ptr"}
FLOATS = {"qk_scale", "eps"}
# Integer arguments the launcher sees as multiples of 16 in the Qwen3-0.6B decode step.
DIV16 = {"k", "n", "k_per_split", "sq_dim"}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int, fp_fusion: bool = True):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = "*i32" if name in INT_PTRS else "*fp32" if name in F32_PTRS else "*bf16"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
        if name.endswith("_ptr") or name.startswith("stride") or name in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def resources(kernel) -> dict:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ttgir = kernel.asm["ttgir"]
    buffers = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x([0-9x]+)x(\w+)", ttgir)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_stack_bytes": int(stack.group(1)) if stack else None,
        "shared_bytes": kernel.metadata.shared,
        "async_copies": ttgir.count("async_copy_global_to_local"),
        "pipelined_buffers": [f"{n} x {shape} {dt}" for n, shape, dt in buffers],
    }


def cases():
    attn = dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64,
                SINGLE_SPLIT=True, DOT_PRECISION="tf32", UPCAST_DOT=False)  # fmt: skip
    for warps, stages in ((2, 5), (4, 3)):
        yield (
            f"decode_per_head_{warps}w{stages}s",
            pds._decode_split_kernel,
            attn,
            warps,
            stages,
            True,
        )
    linear = dict(HAS_BIAS=False, ADD_RESIDUAL=False, SQ_PARTS_PAD=32, SQ_STRIDE=64,
                  EVEN_K=True, M_PAD=32, BLOCK_K=128, IEEE_DOT=False)  # fmt: skip
    yield ("skinny_gate_up_silu_64", sl._skinny_linear_kernel,
           dict(linear, SILU_MUL=True, SCALE_ROWS=True, SPLIT_K=1, BLOCK_N=64), 4, 4, True)  # fmt: skip
    yield ("skinny_o_residual_32_split4", sl._skinny_linear_kernel,
           dict(linear, SILU_MUL=False, SCALE_ROWS=False, SPLIT_K=4, BLOCK_N=32,
                ADD_RESIDUAL=True), 4, 4, True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name, fn, constexprs, warps, stages, fusion in cases():
        row = {"kernel": name, "num_warps": warps, "num_stages": stages,
               **resources(compile_sm90(fn, constexprs, warps, stages, fusion))}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        doc = {"triton": triton.__version__, "target": "cuda:90",
               "command": " ".join(["benchmarks/sm90_resources.py", *sys.argv[1:]]), "rows": rows}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
