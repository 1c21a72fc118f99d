"""Host time per decode step of the engine at a full batch, and where it goes.

    python benchmarks/host_profile.py [--num-requests 512] [--prompt-len 256]
                                      [--decode-steps 64] [--top 15] [--device cpu]

Mirrors `throughput.py`'s decode_heavy workload (greedy, ignore_eos, everything submitted
at once, async scheduling, no tokenizer) on a tiny random Qwen3 (1 layer, hidden 64,
vocab 512), so the engine's per-request Python is what there is to see. Prefill runs
first, untimed; then `--decode-steps` steps with every request decoding are timed one by
one, and the same number again under cProfile.

On a GPU the model forward, the LM head, the sampler and the input/update kernels are
device work: the host only launches them. On the CPU they are arithmetic (the paged
attention reference alone is ~85 ms a step here), so each is wrapped, unchanged, in a
timer that also pauses the profiler, and reported apart:
- `ms_per_step_host`: median over steps of wall time minus that device work; the
  number this benchmark exists to cut.
- `ms_per_step_model_and_sampler`, `ms_per_step_kernel_refs`: the device work on the CPU.
- `ms_per_step_python_excl_torch`: the host time times the share of Python and numpy
  (everything but torch) in the profile.
- `profiled_split_ms_per_step`: the host time under cProfile (inflated ~2.5x by it) by
  kind: this repository's Python, torch ops, torch's Python, everything else (numpy,
  builtins); `top`: functions by tottime.
With `--device cuda` (bf16, CUDA graphs) nothing is wrapped: `ms_per_step_host` is then
the whole step, and `engine_cpu_ms_per_step` / `engine_wait_ms_per_step` (the engine's
own split) and the profile (launches, syncs) say where it goes.

CPU caveat: the CPU forward streams ~80 MB of KV cache through the caches every step, so
the host work after it runs cold; the host numbers here are an upper bound of what the
same Python costs beside a GPU.

This is a benchmark, not a test: it measures and writes JSON to stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 512
# Kernels the runner launches per step, by the module that calls them: a Triton launch
# on a GPU, the torch reference on the CPU.
KERNEL_CALLS = [
    ("pdserve.runner.mrv2.input_batch", "prepare_inputs"),
    ("pdserve.runner.mrv2.input_batch", "gather_block_tables"),
    ("pdserve.runner.mrv2.input_batch", "compute_slot_mapping"),
    ("pdserve.runner.mrv2.model_runner", "post_update"),
    ("pdserve.runner.mrv2.staged_writes", "apply_staged_writes"),
]


def build_tiny_qwen3(path: Path) -> None:
    """Random fp32 weights, no tokenizer files (as throughput.py's model directory)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def make_engine(model_dir: Path, num_requests: int, device: str):
    from pdserve.runner.engine import Engine

    return Engine.from_args(
        model=str(model_dir),
        dtype="float32" if device == "cpu" else "bfloat16",
        device=device,
        runner="mrv2",
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        async_scheduling=True,
        max_model_len=1024,
        # 1 layer x K,V x 2 heads x 32 x 4 B = 512 B per token; 256 MiB holds 512k tokens.
        kv_cache_memory_bytes=256 << 20,
    )


def add_requests(engine, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    from pdserve.runner.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = np.random.default_rng(1234)
    for i, prompt in enumerate(rng.integers(0, VOCAB, size=(num_requests, prompt_len)).tolist()):
        engine.add_request(f"req-{i}", prompt, params)


def run_prefill(engine, num_requests: int) -> None:
    """Step until every request decodes (is at most one token behind) and none waits."""
    sched = engine.scheduler
    while (
        sched.waiting
        or len(sched.running) < num_requests
        or any(r.num_tokens_with_inflight - r.num_computed_tokens > 1 for r in sched.running)
    ):
        engine.step()


def decode_step(engine) -> int:
    """One step of throughput.py's benchmark loop. Returns the tokens it handed out."""
    seen = 0
    for d in engine.step():
        seen += len(d.new_token_ids)
    return seen


class DeviceWork:
    """Calls `fn` unchanged with the profiler paused, adding its wall time to `clock`."""

    def __init__(self, fn, clock: list[float], profiler: list[cProfile.Profile | None]):
        self.fn, self.clock, self.profiler = fn, clock, profiler

    def __call__(self, *args, **kwargs):
        prof = self.profiler[0]
        if prof is not None:
            prof.disable()
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.clock[0] += time.perf_counter() - start
            if prof is not None:
                prof.enable()


def classify(stats: pstats.Stats, repo: str) -> tuple[dict[str, float], list[dict]]:
    split = {"python_ours": 0.0, "torch_ops": 0.0, "torch_python": 0.0, "other": 0.0}
    rows = []
    for (filename, line, name), (_, ncalls, tottime, _, _) in stats.stats.items():
        if filename.startswith(repo):
            kind = "python_ours"
        elif "/torch/" in filename:
            kind = "torch_python"
        elif filename == "~" and ("torch" in name or "Tensor" in name):
            kind = "torch_ops"
        else:
            kind = "other"
        split[kind] += tottime
        where = f"{filename.removeprefix(repo + '/')}:{line}" if filename != "~" else "~"
        rows.append({"function": f"{where}({name})", "ncalls": ncalls, "tottime": tottime})
    rows.sort(key=lambda r: -r["tottime"])
    return split, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = Path(tempfile.mkdtemp(prefix="tiny-qwen3-"))
    build_tiny_qwen3(model_dir)
    engine = make_engine(model_dir, args.num_requests, args.device)
    n = args.decode_steps
    # Timed steps, profiled steps and slack: no request may finish inside them.
    add_requests(engine, args.num_requests, args.prompt_len, max_tokens=2 * n + 16)
    run_prefill(engine, args.num_requests)

    runner = engine.runner
    model_s, kernel_s = [0.0], [0.0]
    active: list[cProfile.Profile | None] = [None]
    if args.device == "cpu":
        # Instance attributes: nn.Module.__call__ looks up self.forward, and the runner
        # calls self.model.compute_logits and self.sampler, so these wrap exactly the
        # device work.
        runner.model.forward = DeviceWork(runner.model.forward, model_s, active)
        runner.model.compute_logits = DeviceWork(runner.model.compute_logits, model_s, active)
        runner.sampler = DeviceWork(runner.sampler, model_s, active)
        for module_name, fn_name in KERNEL_CALLS:
            module = importlib.import_module(module_name)
            setattr(module, fn_name, DeviceWork(getattr(module, fn_name), kernel_s, active))

    stats0 = (engine.stats.num_steps, engine.stats.cpu_s, engine.stats.wait_s)
    host, model, kernels = [], [], []
    for _ in range(n):
        m0, k0 = model_s[0], kernel_s[0]
        start = time.perf_counter()
        seen = decode_step(engine)
        wall = time.perf_counter() - start
        assert seen == args.num_requests, f"{seen} tokens in a full decode step"
        model.append(model_s[0] - m0)
        kernels.append(kernel_s[0] - k0)
        host.append(wall - model[-1] - kernels[-1])
    steps = engine.stats.num_steps - stats0[0]
    cpu_ms = 1e3 * (engine.stats.cpu_s - stats0[1]) / steps
    wait_ms = 1e3 * (engine.stats.wait_s - stats0[2]) / steps

    active[0] = profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        decode_step(engine)
    profiler.disable()
    # This repository's root, as the profile spells its file names.
    repo = str(Path(importlib.import_module("pdserve.runner").__file__).parent.parent)
    split, rows = classify(pstats.Stats(profiler), repo)
    ms = 1e3 / n
    json.dump(
        {
            "num_requests": args.num_requests,
            "decode_steps": n,
            "device": args.device,
            "ms_per_step_host": 1e3 * statistics.median(host),
            "ms_per_step_host_mean": 1e3 * statistics.fmean(host),
            # The host median split by the profile's shares (Python and numpy vs torch).
            "ms_per_step_python_excl_torch": 1e3
            * statistics.median(host)
            * (split["python_ours"] + split["other"])
            / sum(split.values()),
            "ms_per_step_model_and_sampler": 1e3 * statistics.median(model),
            "ms_per_step_kernel_refs": 1e3 * statistics.median(kernels),
            "engine_cpu_ms_per_step": cpu_ms,  # includes the device work on the CPU
            "engine_wait_ms_per_step": wait_ms,
            "profiled_split_ms_per_step": {k: round(v * ms, 3) for k, v in split.items()},
            "top": [
                f"{r['tottime'] * ms:6.3f} ms {r['ncalls'] / n:8.1f} calls  {r['function']}"
                for r in rows[: args.top]
            ],
        },
        sys.stdout,
        indent=1,
    )
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
