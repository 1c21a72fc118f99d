"""vLLM 0.25 on the same model and workloads as `throughput.py` (its `--peer vllm`).

    python benchmarks/vllm_peer.py --model-dir DIR --workloads decode_heavy,... [--max-num-seqs 512]

Runs in its own process (started by throughput.py after our engine has released the
GPU), so vLLM's imports and memory never mix with ours. Prints one JSON line per
workload: `{"workload", "vllm_output_tok_s", "vllm_total_tok_s", "vllm_elapsed_s"}`.
Prompts are the same seeded random token ids as ours; outputs are forced (`ignore_eos`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from throughput import WORKLOADS, make_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151_936, help="prompt ids are below this")
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model_dir,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=0.7,  # our parent process still holds a CUDA context
        kv_cache_dtype=args.kv_cache_dtype,
        seed=0,
    )
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(w, args.vocab)]
        params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
        llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        assert produced == w.num_requests * w.output_len, "vLLM did not force the output length"
        row = {
            "workload": name,
            "vllm_elapsed_s": elapsed,
            "vllm_output_tok_s": produced / elapsed,
            "vllm_total_tok_s": (produced + w.num_requests * w.prompt_len) / elapsed,
        }
        print("VLLM_RESULT " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
