"""Offline throughput of the engine on a random-weight bf16 model of the Qwen3-0.6B shape.

    python benchmarks/throughput.py [--workloads decode_heavy,long_prefill,small_batch]
                                    [--hf | --no-hf] [--peer vllm] [--out benchmarks/results/DIR]

Three workloads, prompts of random token ids from a fixed seed, output length forced
(`ignore_eos`), all requests submitted at once. Per workload one JSON object with the
engine's numbers, transformers' `generate_batch` on the same model and workload (`hf_*`,
unless --no-hf), and the time floor of this H200:

    floor = prefill FLOPs / 789 TFLOP/s
          + sum over decode steps of (1.19 GB weights + KV bytes read) / 4.28 TB/s

with KV read at 114,688 bytes per context token (28 layers x 2 x 8 heads x 128 x 2 B).
This is a benchmark, not a test: it measures and writes JSON; tests/ checks correctness.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from run_meta import git_commit

from pdserve.runner.config import CUDA_GRAPH_SCOPES, DECODE_ATTENTION_KERNELS

PEAK_FLOPS = 789e12  # bf16 dense GEMM measured on this H200
PEAK_BYTES = 4.28e12  # device-to-device read+write bandwidth measured on this H200
WEIGHT_BYTES = 1.19e9
KV_BYTES_PER_TOKEN = 114_688


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    metric: str  # the headline number of the workload


WORKLOADS = {
    w.name: w
    for w in [
        Workload("decode_heavy", 512, 256, 256, "output_tok_s"),
        Workload("long_prefill", 128, 2048, 128, "total_tok_s"),
        Workload("small_batch", 32, 256, 256, "output_tok_s"),
    ]
}


def qwen3_06b_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151_643,
        eos_token_id=151_645,
        architectures=["Qwen3ForCausalLM"],
    )


def build_model_dir(path: Path):
    """Random bf16 weights (seeded), saved once; returns the in-memory HF model too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(qwen3_06b_config(), dtype=torch.bfloat16)
    model.eval()
    if not (path / "config.json").exists():
        model.save_pretrained(path)
    return model


def random_model_engine(
    max_num_batched_tokens: int = 16384,
    decode_attention: str = "auto",
    gpu_memory_utilization: float = 0.8,
    max_num_seqs: int = 512,
    **engine_args,
):
    """The profiling scripts' engine: a fresh random Qwen3-0.6B-shaped model directory and
    the throughput runs' settings (512 sequences, 80% of the GPU unless told); `engine_args`
    go to `Engine.from_args` as well."""
    from pdserve.runner.engine import Engine

    model_dir = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-random-"))
    build_model_dir(model_dir)  # the in-memory copy it returns is dropped here
    torch.cuda.empty_cache()
    return Engine.from_args(
        model=str(model_dir), dtype="bfloat16", max_model_len=4096, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=gpu_memory_utilization,
        decode_attention=decode_attention, **engine_args,
    )  # fmt: skip


def floor_seconds(w: Workload, batch: int) -> float:
    """Time floor: prefill FLOPs at peak + decode steps at peak bandwidth."""
    params_flops = 2 * 0.44e9  # non-embedding matmul params (28 x 15.7M) + LM head 155M
    prefill_tokens = w.num_requests * w.prompt_len
    # causal attention: 2 (QK, PV) x 2 FLOP x heads x head_dim x avg context per token
    attn = 4 * 16 * 128 * 28 * (w.prompt_len / 2) * prefill_tokens
    t = (params_flops * prefill_tokens + attn) / PEAK_FLOPS
    waves = -(-w.num_requests // batch)
    for wave in range(waves):
        rows = min(batch, w.num_requests - wave * batch)
        for step in range(w.output_len - 1):
            ctx = w.prompt_len + step + 1
            t += (WEIGHT_BYTES + rows * ctx * KV_BYTES_PER_TOKEN) / PEAK_BYTES
    return t


def make_prompts(w: Workload, vocab: int, seed: int = 1234) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(w.num_requests, w.prompt_len)).tolist()


def run_engine(engine, w: Workload, prompts: list[list[int]], temperature: float = 0.0) -> dict:
    from pdserve.runner.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=w.output_len, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    stats0 = (engine.stats.num_steps, engine.stats.cpu_s)
    paths0 = engine.steps_by_path()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{w.name}-{i}", p, params)
    while engine.has_unfinished():
        for d in engine.step():
            now = time.perf_counter()
            n = len(d.new_token_ids)
            if n:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] = count.get(d.request_id, 0) + n
    elapsed = time.perf_counter() - start
    steps = engine.stats.num_steps - stats0[0]
    cpu = engine.stats.cpu_s - stats0[1]
    out_tokens = sum(count.values())
    assert out_tokens == w.num_requests * w.output_len, "output length was not forced"
    tpots = sorted(1e3 * (last[r] - first[r]) / (count[r] - 1) for r in count if count[r] > 1)
    return {
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + w.num_requests * w.prompt_len) / elapsed,
        "tpot_p50_ms": statistics.median(tpots),
        "tpot_p99_ms": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
        "steps": steps,
        "cpu_ms_per_step": 1e3 * cpu / max(steps, 1),
        # What ran the workload's steps (eager / cuda_graph / cuda_graph_whole_step).
        "steps_by_path": {k: n - paths0.get(k, 0) for k, n in engine.steps_by_path().items()},
    }


def run_hf(model, w: Workload, prompts: list[list[int]]) -> dict:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=w.output_len,
        min_new_tokens=w.output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=cfg)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outs.values())
    return {
        "hf_elapsed_s": elapsed,
        "hf_output_tok_s": produced / elapsed,
        "hf_total_tok_s": (produced + w.num_requests * w.prompt_len) / elapsed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run transformers' generate_batch on each workload",
    )
    ap.add_argument("--max-num-seqs", type=int, default=512)
    # 16,384: vLLM's own default for offline use (its LLM class) on GPUs of >= 70 GiB such
    # as this H200; the peer runs with the same value. At 8,192 an eager chunked-prefill
    # step of this small model is bound by the host's launches (~28 ms of host vs ~22 ms of
    # device per step, benchmarks/profile_step.py --phase prefill); at 16,384 the step is
    # device-bound (long_prefill 1.90 s at fad9d3d -> 1.76 s at 134a581, together with the
    # fused attention-input kernel).
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (vLLM's --block-size)"
    )
    ap.add_argument("--model-dir", default=None, help="reuse a saved model directory")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--decode-attention",
        choices=DECODE_ATTENTION_KERNELS,
        default="auto",
        help="the Triton decode attention kernel (kernels/paged_attention_triton.py)",
    )
    ap.add_argument(
        "--cuda-graph-scope",
        choices=CUDA_GRAPH_SCOPES,
        default="step",
        help="what a decode graph holds: the layers, or the whole step (runner/config.py)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        default="auto",
        help="the paged KV cache's dtype (vLLM's flag; the floor stays the bf16 cache's)",
    )
    ap.add_argument(
        "--peer",
        choices=["vllm"],
        default=None,
        help="also run vLLM on the same model and workloads (benchmarks/vllm_peer.py)",
    )
    args = ap.parse_args()

    from pdserve.runner.engine import Engine

    model_dir = Path(args.model_dir or tempfile.mkdtemp(prefix="qwen3-0.6b-random-"))
    hf_model = build_model_dir(model_dir)
    if not args.hf:
        del hf_model
        hf_model = None
        torch.cuda.empty_cache()
    t = time.perf_counter()
    engine = Engine.from_args(
        model=str(model_dir),
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=0.8,
        decode_attention=args.decode_attention,
        cuda_graph_scope=args.cuda_graph_scope,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    startup = time.perf_counter() - t
    graphs = getattr(engine.runner, "graphs", None)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = []
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        prompts = make_prompts(w, 151_936)
        # Warm-up: the same shapes (all requests, a few output tokens) with other prompts (no
        # prefix hits later), so Triton compiles every kernel variant the timed run needs
        # outside it; an 8-request warm-up left ~40% of decode_heavy's time to the JIT.
        run_engine(
            engine,
            Workload(w.name, w.num_requests, w.prompt_len, 4, w.metric),
            make_prompts(w, 151_936, seed=99),
        )
        row = {
            "workload": w.name,
            "requests": w.num_requests,
            "prompt_len": w.prompt_len,
            "output_len": w.output_len,
            **run_engine(engine, w, prompts),
        }
        floor = floor_seconds(w, args.max_num_seqs)
        row["floor_s"] = floor
        row["floor_fraction"] = floor / row["elapsed_s"]
        if hf_model is not None:
            row.update(run_hf(hf_model, w, prompts))
        else:
            row.update({"hf_output_tok_s": None, "hf_total_tok_s": None})
        row.update(
            {
                "device": device,
                "commit": git_commit(),
                "command": " ".join(sys.argv),
                "startup_s": startup,
                "runner": engine.runner_name,
                "cuda_graphs": len(graphs.graphs) if graphs else 0,
                "cuda_graph_scope": args.cuda_graph_scope,
                "kv_cache_dtype": args.kv_cache_dtype,
                "kv_blocks": engine.runner.num_blocks,
                "greedy_tail_graphs": len(graphs.tail_graphs) if graphs else 0,
                "graph_capture_s": graphs.capture_seconds if graphs else 0.0,
                "graph_memory_mib": graphs.memory_bytes / 2**20 if graphs else 0.0,
            }
        )
        results.append(row)
        write_row(out_dir, row)
    if args.peer == "vllm":
        del engine, hf_model, graphs
        gc.collect()
        torch.cuda.empty_cache()
        peer = run_vllm_peer(model_dir, args)
        for row in results:
            row.update(peer.get(row["workload"], {"vllm_output_tok_s": None}))
            write_row(out_dir, row)
    return 0


def write_row(out_dir: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    kv = row.get("kv_cache_dtype", "auto")
    name = f"throughput_{row['workload']}{'' if kv == 'auto' else '_kv_' + kv}.json"
    (out_dir / name).write_text(json.dumps(row, indent=2) + "\n")


def run_vllm_peer(
    model_dir: Path, args: argparse.Namespace, vocab: int = 151_936
) -> dict[str, dict]:
    """vLLM in a child process once our engine has let go of the GPU; {workload: numbers}.
    Its prompts are ids below `vocab`, seeded as ours (`make_prompts`)."""
    cmd = [
        sys.executable,
        str(Path(__file__).parent / "vllm_peer.py"),
        f"--model-dir={model_dir}",
        f"--workloads={args.workloads}",
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
        f"--vocab={vocab}",
        f"--kv-cache-dtype={getattr(args, 'kv_cache_dtype', 'auto')}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    sys.stderr.write(proc.stderr[-4000:])
    rows = [
        json.loads(line.split(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("VLLM_RESULT ")
    ]
    if proc.returncode != 0 or not rows:
        print(f"vLLM peer failed (exit {proc.returncode})", file=sys.stderr)
    return {r.pop("workload"): r for r in rows}


if __name__ == "__main__":
    raise SystemExit(main())
