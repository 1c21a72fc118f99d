"""PD vs colocated under load: TTFT and ITL p50/p99 and goodput per request rate.

    python benchmarks/pd_vs_colocated.py [--model DIR] [--workers 2] [--rates 0.5,1,2,4]
        [--modes pd,pd-cond,colocated] [--cond-tokens 16384]
        [--num-prompts 64] [--input-min 2048] [--input-max 8192] [--output-len 256]
        [--slo ttft:500 tpot:20] [--serve-args "--kv-transport cuda_ipc"] [--out DIR]

The [multi-gpu] comparison. For each mode it starts `pdserve serve` (a local Ray instance
with real workers): PD runs `--workers / 2` prefill and as many decode workers, `pd-cond`
the same with conditional disaggregation (`--pd-max-prefill-queue-tokens`), colocated
runs `--workers` independent workers that prefill and decode alike; `pdserve serve` gives
each worker a whole GPU when there are enough. Seeded prompts (random token ids, lengths
uniform in [input-min, input-max], forced output length) go to each deployment at each
Poisson rate through `pdserve bench`'s load generator: a fresh set per rate, the same sets
in every mode (one server runs every rate of a mode, so a set sent twice would be a prefix
cache hit the second time, and no prefill at all), and the report per (mode,
rate) is `pdserve bench`'s: TTFT, TPOT, ITL, goodput (requests per second meeting every
SLO). First, two fresh prompts are completed greedily one at a time in each mode: each
prefill then runs alone on the same kernels, so the modes must agree token for token
(`greedy_agree`), which checks the KV moved between workers end to end. (Prompts
prefilled in a batch would not do: the batch changes cuBLAS's kernel choice and so the
KV's last bits, and a random model's near-tied logits flip on that.) Each row also keeps
the router's path counters (remote-prefill decisions, failed remote prefills, pulls by
transport, tier blocks, puts and hits), so a fallback cannot pass for PD: `server_counters` since the server started,
`server_counters_this_rate` what changed during that rate. Writes
`pd_vs_colocated_<device-kind>.json` (with `gpus`, the device, the commit and the
command; rewritten after every rate, so a run cut short keeps what it measured) and, with
matplotlib, a PNG of goodput and TTFT p99 against the rate (`--replot JSON` draws it from
the JSON elsewhere). A benchmark, not a test; on a machine without GPUs it runs the same
path on the CPU (use a small model and short prompts there). A model directory for the
GPU: `python benchmarks/synthetic_model.py DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import device_kind, git_commit  # noqa: E402

FIRST_ID = 1000  # as `pdserve bench`: clear of special tokens


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


MODES = ("pd", "pd-cond", "colocated")


def serve_args(mode: str, workers: int, extra: list[str], cond_tokens: int) -> list[str]:
    """`pd-cond` is PD with conditional disaggregation: prompts arriving while every
    prefill worker has `cond_tokens` prompt tokens in flight prefill on their decode worker."""
    if mode in ("pd", "pd-cond"):
        assert workers >= 2 and workers % 2 == 0, "PD needs an even number of workers (>= 2)"
        cond = ["--pd-max-prefill-queue-tokens", str(cond_tokens)] if mode == "pd-cond" else []
        return ["--mode", "pd", "--prefill-workers", str(workers // 2),
                "--decode-workers", str(workers // 2), *cond, *extra]  # fmt: skip
    return ["--mode", "colocated", "--decode-workers", str(workers), *extra]


def greedy_texts(url: str, model: str, prompts: list, max_tokens: int, timeout_s: float) -> list:
    """Each prompt's greedy completion, one request at a time (the same batch shapes in
    every mode, so the modes must agree token for token: the KV moved between GPUs in PD
    mode is checked end to end)."""
    import httpx

    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


# What path the requests took, from the router's /metrics (cumulative since the start):
# remote-prefill decisions by reason, failed remote prefills by error, pulls by transport.
# Decisions, failures, pulls by transport, and the tier's blocks, puts and hits (a decode
# worker loads a prompt's blocks from the tier instead of pulling them when the prefill
# worker's write-behind got there first: then pulls < remote decisions). With
# --kv-layer-wise also the early tickets and how their first tokens reached the decode
# worker (relayed ahead of the KV, or at the end of the pull).
PATH_METRICS = (
    "pdserve:pd_decisions",
    "pdserve:pd_prefill_failures",
    "pdserve:kv_transfer_pulls",
    "pdserve:kv_tier",
    "pdserve:kv_early_tickets",
    "pdserve:kv_early_first_tokens",
)


def path_counters(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(PATH_METRICS):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def run_mode(
    mode: str, args: argparse.Namespace, prompt_sets: list, log_dir: Path, record: Callable
) -> tuple[list[dict], list]:
    """Rows of this mode, one per rate (`prompt_sets[i]` at `args.rates[i]`), each also
    passed to `record(row, texts)` as it lands (a run cut short keeps what it measured);
    and the greedy completions."""
    from tqdm import tqdm

    from pdserve.cluster.bench import BenchConfig, run_load
    from pdserve.cluster.bench_stats import aggregate, parse_goodput
    from pdserve.cluster.endpoint import probe_model
    from pdserve.cluster.serve_process import ServeProcess

    extra = [*(["--model", args.model] if args.model else []), *shlex.split(args.serve_args)]
    server = ServeProcess(log_dir, *serve_args(mode, args.workers, extra, args.cond_tokens))
    rows = []
    try:
        model = probe_model(server.url, None)
        # Fresh prompts (no prefix cached anywhere), one at a time: every prefill runs
        # alone in every mode, so the same kernels compute the same KV bits.
        fresh = make_prompts(2, args.input_min, args.input_max, args.vocab_size, args.seed + 7)
        texts = greedy_texts(server.url, model, fresh, 32, args.timeout)
        # Untimed warm-up on other prompts of the same lengths: the first requests of a
        # fresh server pay compiles and allocations that no rate should be charged with.
        warm = make_prompts(min(8, args.num_prompts), args.input_min, args.input_max,
                            args.vocab_size, args.seed + 99)  # fmt: skip
        warm_cfg = BenchConfig(
            base_url=server.url, model=model, output_len=4, timeout_s=args.timeout
        )
        with tqdm(total=len(warm), file=sys.stderr, desc=f"{mode} warm-up", unit="req") as bar:
            asyncio.run(run_load(warm_cfg, model, warm, bar))
        before = path_counters(server.url)  # after the greedy check and the warm-up
        for rate, prompts in zip(args.rates, prompt_sets, strict=True):
            cfg = BenchConfig(
                base_url=server.url, model=model, num_prompts=len(prompts),
                output_len=args.output_len, request_rate=rate, goodput=tuple(args.slo),
                seed=args.seed, timeout_s=args.timeout,
            )  # fmt: skip
            desc = f"{mode} @ {rate} req/s"
            with tqdm(total=len(prompts), file=sys.stderr, desc=desc, unit="req") as bar:
                results, duration = asyncio.run(run_load(cfg, model, prompts, bar))
            report = aggregate(results, duration, parse_goodput(cfg.goodput))
            counters = path_counters(server.url)
            report["server_counters"] = counters  # since the server started
            report["server_counters_this_rate"] = {
                k: v - before.get(k, 0.0) for k, v in counters.items() if v != before.get(k, 0.0)
            }
            before = counters
            rows.append({"mode": mode, "request_rate": rate, **report})
            print(json.dumps(_brief(rows[-1])), flush=True)
            record(rows[-1], texts)
    finally:
        server.stop()
    return rows, texts


def _brief(row: dict) -> dict:
    def pick(name: str) -> dict:
        return {k: round(row[name][k], 1) for k in ("p50", "p99") if row[name].get(k) is not None}

    return {
        "mode": row["mode"], "rate": row["request_rate"], "completed": row["completed"],
        "failed": row["failed"], "goodput": row["goodput"], "ttft_ms": pick("ttft_ms"),
        "itl_ms": pick("itl_ms"), "tpot_ms": pick("tpot_ms"),
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU image has none: `--replot JSON` draws it elsewhere
        print(f"matplotlib missing: no {path.name}; run --replot on the JSON", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        rates = [r["request_rate"] for r in mine]
        a.plot(rates, [r["goodput"] or 0.0 for r in mine], marker="o", label=mode)
        b.plot(rates, [r["ttft_ms"].get("p99") for r in mine], marker="o", label=mode)
    a.set(xlabel="request rate (req/s)", ylabel="goodput (req/s within SLOs)")
    b.set(xlabel="request rate (req/s)", ylabel="TTFT p99 (ms)", yscale="log")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the server's default model")
    ap.add_argument("--workers", type=int, default=2, help="total workers (GPUs) per mode")
    ap.add_argument("--modes", default="pd,colocated", help=f"of {', '.join(MODES)}")
    ap.add_argument(
        "--cond-tokens", type=int, default=16384,
        help="pd-cond: prefill worker tokens in flight past which the decode worker prefills",
    )  # fmt: skip
    ap.add_argument("--rates", default="0.5,1,2,4", help="Poisson request rates, req/s")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-min", type=int, default=2048)
    ap.add_argument("--input-max", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=32000, help="ids drawn from [1000, V)")
    ap.add_argument("--slo", nargs="+", default=["ttft:500", "tpot:20"], metavar="METRIC:MS")
    ap.add_argument("--serve-args", default="", help="more `pdserve serve` flags, one string")
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only draw the PNG of a run")
    args = ap.parse_args()
    if args.replot:
        path = Path(args.replot)
        plot(json.loads(path.read_text())["rows"], path.with_suffix(".png"))
        return 0
    args.rates = [float(r) for r in args.rates.split(",")]
    if bad := set(args.modes.split(",")) - set(MODES):
        ap.error(f"unknown modes {sorted(bad)}; known: {', '.join(MODES)}")
    if not 0 < args.input_min <= args.input_max or args.num_prompts < 1:
        ap.error("need 0 < --input-min <= --input-max and --num-prompts >= 1")

    # Seeds clear of the greedy check's (seed + 7) and the warm-up's (seed + 99).
    prompt_sets = [
        make_prompts(
            args.num_prompts, args.input_min, args.input_max, args.vocab_size,
            args.seed + 1000 * (i + 1),
        )
        for i in range(len(args.rates))
    ]  # fmt: skip
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.cuda.get_device_name() if gpus else "cpu"
    log_dir = Path(tempfile.mkdtemp(prefix="pd-vs-colocated-"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"pd_vs_colocated_{device_kind()}"
    meta = {
        "gpus": gpus, "device": device, "device_kind": device_kind(), "workers": args.workers,
        "commit": git_commit(),
        "command": " ".join(["benchmarks/pd_vs_colocated.py", *sys.argv[1:]]),
        "prompts": {"n": args.num_prompts, "input_min": args.input_min,
                    "input_max": args.input_max, "output_len": args.output_len,
                    "fresh_set_per_rate": True},
        "slos_ms": dict(s.split(":") for s in args.slo), "server_logs": str(log_dir),
    }  # fmt: skip
    rows: list[dict] = []
    greedy: dict[str, list] = {}

    def record(row: dict, texts: list) -> None:
        rows.append(row)
        greedy[row["mode"]] = texts
        agree = len({json.dumps(t) for t in greedy.values()}) == 1 if len(greedy) > 1 else None
        doc = {**meta, "greedy_agree": agree, "greedy_texts": greedy, "rows": rows}
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")

    for mode in args.modes.split(","):
        run_mode(mode, args, prompt_sets, log_dir, record)
    if len(greedy) > 1:
        agree = len({json.dumps(t) for t in greedy.values()}) == 1
        print(f"greedy completions agree across modes: {agree}", file=sys.stderr)
    plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.json (and .png with matplotlib)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
