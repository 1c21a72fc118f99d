"""What structured output costs a decode step. Not a test.

The throughput benchmark's random Qwen3-0.6B-shaped bf16 model with a real byte-level
tokenizer put beside it (`--tokenizer-dir`: SmolLM2's, 49,152 tokens; the model's other
ids spell nothing and are never allowed under a grammar). `--rows` requests of `--prompt`
random token ids, all at once, `--output` tokens each (`ignore_eos`: a row whose pattern
is complete keeps sampling EOS, so every variant makes the same number of tokens), once
per variant: no constraint (greedy: the whole-step graph; sampled: the graph's forward,
then the eager sampler), and greedy / sampled under JSON mode, a JSON schema and a regex
(the graph's forward, the eager sampler with the grammar's mask and advance). Each
variant's grammar is compiled in a warm-up (its time is reported as `compile_s`).

One JSON object per variant: `variant, output_tok_s, ms_per_token_step, compile_s`, with
the device and commit, to `<out>/structured_overhead_<device>.json`.

    python benchmarks/structured_overhead.py --tokenizer-dir DIR [--rows 32] \
        [--prompt 256] [--output 256] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from run_meta import device_kind, git_commit
from throughput import build_model_dir

from pdserve import LLM, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
}
VARIANTS = {
    "none": None,
    "json_object": {"json_object": True},
    "json_schema": {"json": PERSON},
    "regex": {"regex": r"([A-Z][a-z]{1,12} ){1,8}[0-9]{1,6}(, [a-z ]{1,40})*\."},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer-dir", required=True)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    model_dir = Path(tempfile.mkdtemp(prefix="qwen3-structured-"))
    build_model_dir(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer_dir) / name, model_dir / name)
    llm = LLM(model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=512,
              max_num_batched_tokens=16384, gpu_memory_utilization=0.8)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(17, 49_152, (args.prompt,), generator=gen).tolist()}
        for _ in range(args.rows)
    ]
    rows = []
    for variant, spec in VARIANTS.items():
        for temperature in (0.0, 1.0):

            def params(n: int, spec=spec, temperature=temperature) -> list[SamplingParams]:
                return [
                    SamplingParams(
                        temperature=temperature,
                        seed=i,
                        max_tokens=n,
                        ignore_eos=True,
                        structured_outputs=spec,
                    )  # fmt: skip
                    for i in range(args.rows)
                ]

            start = time.perf_counter()
            llm.generate(prompts[:1], params(2)[:1], use_tqdm=False)  # compiles the grammar
            compile_s = time.perf_counter() - start
            llm.generate(prompts, params(8), use_tqdm=False)  # warm-up on these shapes
            start = time.perf_counter()
            outs = llm.generate(prompts, params(args.output), use_tqdm=False)
            elapsed = time.perf_counter() - start
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            row = {
                "variant": variant,
                "temperature": temperature,
                "rows": args.rows,
                "prompt": args.prompt,
                "output": args.output,
                "output_tok_s": round(made / elapsed, 1),
                "ms_per_token_step": round(1e3 * elapsed / args.output, 3),
                "compile_s": round(compile_s, 3),
                "steps_by_path": llm.engine.steps_by_path(),
                "sample_text": outs[0].outputs[0].text[:120],
                "device": device_kind(),
                "commit": git_commit(),
                "command": " ".join(sys.argv),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(args.out) / f"structured_overhead_{device_kind()}.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
