"""Multi-turn conversations on several decode workers: does each next turn find its
conversation's KV where the router sends it?

    python benchmarks/multiturn.py [--model DIR] [--workers 2] [--mode colocated]
        [--conversations 8] [--turns 4] [--first-len 256] [--turn-len 32]
        [--output-len 16] [--serve-args "..."] [--out DIR] [--tag NAME]

Starts `pdserve serve` (a local Ray instance, `--decode-workers N`; PD mode adds as many
prefill workers) and runs C conversations at once, each T turns, one after another:
turn 1 is a prompt of `first-len` random token ids; each later turn's prompt is the
previous prompt, the reply's tokens and `turn-len` new ones, as a chat client resends
the whole conversation, after a seeded pause (`think-max-s`) that keeps the
conversations from moving in lockstep (in lockstep they arrive in one order every turn,
and a pick by load alone would keep each on one worker by accident). The reply's ids come from its logprobs with
`return_tokens_as_token_ids`, which every pdserve version takes. Reports per turn the
TTFT (streamed: the first token's arrival), the time per output token after it (p50 and
mean over replies: a prompt prefilled on a decode worker slows that worker's other
replies), the router's PD decisions by reason and, over turns >= 2, the decode workers'
prefix-cache hit rate and the prompt tokens they computed (from /metrics: what the
workers really did, not what the router meant to happen). Writes
`multiturn[_<tag>]_<device-kind>.json` with the commit and the command. A benchmark, not a test:
on the CPU use a small model and short prompts (the defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import write_result  # noqa: E402

SERIES = ("prefix_cache_queries", "prefix_cache_hits", "worker_prompt_tokens_computed")


def worker_counters(url: str) -> dict[str, dict[str, float]]:
    """Each decode worker's counters in SERIES, from /metrics, and the router's PD
    decisions by reason under the key "router"."""
    import httpx

    out: dict[str, dict[str, float]] = {"router": {}}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        for name in SERIES:
            if line.startswith(f"pdserve:{name}_total{{") and 'role="decode"' in line:
                worker = line.split('worker="', 1)[1].split('"', 1)[0]
                out.setdefault(worker, {})[name] = float(line.rsplit(" ", 1)[1])
        if line.startswith("pdserve:pd_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out["router"][reason] = float(line.rsplit(" ", 1)[1])
    return out


async def conversation(
    client, url: str, model: str, args, rng: random.Random
) -> list[tuple[float, float | None]]:
    """One conversation's turns; returns each turn's TTFT in seconds and its time per
    output token after the first (None for a one-token reply)."""
    vocab = args.vocab_size
    prompt = [rng.randrange(3, vocab) for _ in range(args.first_len)]
    ttfts = []
    for turn in range(args.turns):
        if turn:  # the user reads and types: conversations drift apart in time
            await asyncio.sleep(rng.uniform(0, args.think_max_s))
        body = {
            "model": model, "prompt": prompt, "max_tokens": args.output_len, "stream": True,
            "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }  # fmt: skip
        start, first, last, reply = time.monotonic(), None, None, []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    if tokens:
                        last = time.monotonic()
                        first = first or last
                    reply += [int(t.split(":", 1)[1]) for t in tokens]
        tpot = (last - first) / (len(reply) - 1) if first and len(reply) > 1 else None
        ttfts.append(((first or time.monotonic()) - start, tpot))
        prompt = prompt + reply + [rng.randrange(3, vocab) for _ in range(args.turn_len)]
    return ttfts


async def run_conversations(url: str, model: str, args) -> list[list[tuple[float, float | None]]]:
    import httpx

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.conversations)]
        return await asyncio.gather(*(conversation(client, url, model, args, rng) for rng in rngs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--mode", choices=["colocated", "pd"], default="colocated")
    p.add_argument("--workers", type=int, default=2, help="decode workers")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=256)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument(
        "--think-max-s",
        type=float,
        default=1.0,
        help="before each later turn a seeded pause of up to this many seconds",
    )
    p.add_argument("--vocab-size", type=int, default=49152, help="random ids below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="", help="in the file name: multiturn_<tag>_<device>.json")
    args = p.parse_args()

    from pdserve.cluster.endpoint import probe_model
    from pdserve.cluster.serve_process import ServeProcess

    serve = ["--mode", args.mode, "--decode-workers", str(args.workers)]
    if args.mode == "pd":
        serve += ["--prefill-workers", str(args.workers)]
    if args.model:
        serve += ["--model", args.model]
    serve += shlex.split(args.serve_args)
    server = ServeProcess(Path(tempfile.mkdtemp(prefix="multiturn-")), *serve)
    try:
        model = probe_model(server.url, None)
        before = worker_counters(server.url)
        start = time.monotonic()
        turns = asyncio.run(run_conversations(server.url, model, args))
        seconds = time.monotonic() - start
        after = worker_counters(server.url)
    finally:
        server.stop()

    decided, decided_before = after.pop("router"), before.pop("router")
    decisions = {k: v - decided_before.get(k, 0.0) for k, v in sorted(decided.items())}
    ttfts = [[ttft for ttft, _ in t] for t in turns]
    tpots = [tpot for t in turns for _, tpot in t if tpot is not None]

    def grew(name: str) -> float:
        return sum(after[w].get(name, 0.0) - before.get(w, {}).get(name, 0.0) for w in after)

    queries, hits = grew("prefix_cache_queries"), grew("prefix_cache_hits")
    per_turn = [statistics.median(t[i] for t in ttfts) * 1e3 for i in range(args.turns)]
    fields = {
        "mode": args.mode, "decode_workers": args.workers,
        "conversations": args.conversations, "turns": args.turns,
        "first_len": args.first_len, "turn_len": args.turn_len, "output_len": args.output_len,
        "think_max_s": args.think_max_s, "seconds": round(seconds, 3),
        "ttft_p50_ms_by_turn": [round(x, 1) for x in per_turn],
        "ttft_mean_ms": round(1e3 * statistics.mean(x for t in ttfts for x in t), 1),
        "tpot_p50_ms": round(1e3 * statistics.median(tpots), 3) if tpots else None,
        "tpot_mean_ms": round(1e3 * statistics.mean(tpots), 3) if tpots else None,
        "pd_decisions": {k: v for k, v in decisions.items() if v},
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "prompt_tokens_computed": grew("worker_prompt_tokens_computed"),
        "per_worker_prompt_tokens_computed": {
            w: after[w].get("worker_prompt_tokens_computed", 0.0)
            - before.get(w, {}).get("worker_prompt_tokens_computed", 0.0)
            for w in sorted(after)
        },
    }  # fmt: skip
    print(json.dumps(fields), flush=True)
    stem = f"multiturn_{args.tag}" if args.tag else "multiturn"
    write_result(args.out, stem, "benchmarks/multiturn.py", sys.argv[1:], fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
