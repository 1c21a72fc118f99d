"""`pdserve bench`: an async streaming load generator for any OpenAI-compatible server.

Each request is a streamed `/v1/completions` call with `ignore_eos` and `max_tokens = O`,
so every request produces exactly O tokens and runs are comparable across servers.
Per request the client records, from its own clock:
  TTFT  time to the first chunk that carries content,
  ITL   the gaps between successive content chunks (one sample per gap),
  TPOT  (E2EL - TTFT) / (output_tokens - 1), output_tokens from the usage chunk,
  E2EL  time to the end of the stream.
Arrivals are Poisson at `--request-rate` (inf sends everything at once) or capped at
`--max-concurrency` in flight. Statistics are in `bench_stats` (pure functions).

What it does not know: the server's tokenizer. `random` and `prefix` prompts are token
ids drawn from [1000, --vocab-size), above the special tokens of common vocabularies.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from pdserve.cluster.bench_stats import RequestResult, aggregate, parse_goodput
from pdserve.cluster.endpoint import auth_headers, normalize_base_url, probe_model

FIRST_RANDOM_ID = 1000  # below this, common vocabularies keep special and byte tokens


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    prefix_len: int | None = None  # prefix dataset: shared tokens; None = input_len // 2
    vocab_size: int = 32000
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    goodput: tuple[str, ...] = ()
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.dataset not in ("random", "prefix", "sharegpt"):
            raise ValueError(f"--dataset must be random, prefix or sharegpt, got {self.dataset!r}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if self.request_rate <= 0:
            raise ValueError(
                f"--request-rate must be > 0 (inf = all at once), got {self.request_rate}"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.prefix_len is not None and not 0 <= self.prefix_len < self.input_len:
            raise ValueError("--prefix-len must be in [0, --input-len)")
        if self.vocab_size <= FIRST_RANDOM_ID:
            raise ValueError(f"--vocab-size must be > {FIRST_RANDOM_ID}")


def make_prompts(cfg: BenchConfig) -> list[list[int] | str]:
    """The prompts, deterministic in `cfg.seed`: token-id lists, or texts for sharegpt."""
    rng = random.Random(cfg.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_RANDOM_ID, cfg.vocab_size) for _ in range(n)]

    if cfg.dataset == "random":
        return [ids(cfg.input_len) for _ in range(cfg.num_prompts)]
    if cfg.dataset == "prefix":
        plen = cfg.input_len // 2 if cfg.prefix_len is None else cfg.prefix_len
        prefix = ids(plen)
        return [prefix + ids(cfg.input_len - plen) for _ in range(cfg.num_prompts)]
    return load_sharegpt(Path(cfg.dataset_path or ""), cfg.num_prompts, rng)


def load_sharegpt(path: Path, n: int, rng: random.Random) -> list[str]:
    """First human turn of each conversation; `n` of them in a seeded order."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read ShareGPT JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    texts = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        first = next(
            (t for t in turns or [] if isinstance(t, dict) and t.get("from") == "human"), None
        )
        if first and isinstance(first.get("value"), str) and first["value"].strip():
            texts.append(first["value"])
    if not texts:
        raise ValueError(f"{path}: no conversation has a human turn")
    rng.shuffle(texts)
    return [texts[i % len(texts)] for i in range(n)]


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]
) -> RequestResult:
    start = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ok=False, error=str(chunk["error"])[:200])
                choices = chunk.get("choices") or []
                # A pure finish marker (no text, finish_reason set) carries no token.
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, ValueError) as e:
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    out = int(usage.get("completion_tokens", len(stamps)))
    if not stamps:
        return RequestResult(ok=False, error="the stream carried no content")
    ttft, e2el = (stamps[0] - start) * 1e3, (end - start) * 1e3
    return RequestResult(
        ok=True,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=out,
        ttft_ms=ttft,
        tpot_ms=(e2el - ttft) / (out - 1) if out > 1 else None,
        e2el_ms=e2el,
        itl_ms=tuple((b - a) * 1e3 for a, b in zip(stamps, stamps[1:])),
    )


async def run_load(cfg: BenchConfig, model: str, prompts: list, progress) -> tuple[list, float]:
    """Send every prompt; returns (results in prompt order, wall seconds)."""
    url = normalize_base_url(cfg.base_url) + "/v1/completions"
    headers = auth_headers(cfg.api_key)
    rng = random.Random(cfg.seed + 1)  # arrivals independent of the prompt draw
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    limits = httpx.Limits(max_connections=cfg.max_concurrency or len(prompts))

    async def send(client: httpx.AsyncClient, prompt) -> RequestResult:
        body = {
            "model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        if gate is None:
            result = await one_request(client, url, body, headers)
        else:
            async with gate:
                result = await one_request(client, url, body, headers)
        progress.update(1)
        return result

    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(client, prompt)))
            if cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def run_bench(cfg: BenchConfig) -> tuple[dict, list[dict]]:
    """(the report, one dict per request in prompt order)."""
    from tqdm import tqdm

    slos = parse_goodput(cfg.goodput)
    model = cfg.model or probe_model(normalize_base_url(cfg.base_url), cfg.api_key)
    if cfg.model:
        probe_model(normalize_base_url(cfg.base_url), cfg.api_key)
    prompts = make_prompts(cfg)
    with tqdm(total=len(prompts), file=sys.stderr, desc="requests", unit="req") as bar:
        results, duration = asyncio.run(run_load(cfg, model, prompts, bar))
    report = {
        "base_url": cfg.base_url, "model": model, "dataset": cfg.dataset,
        "num_prompts": cfg.num_prompts, "input_len": cfg.input_len, "output_len": cfg.output_len,
        "request_rate": None if cfg.request_rate == float("inf") else cfg.request_rate,
        "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
    }  # fmt: skip
    report.update(aggregate(results, duration, slos))
    errors = [r.error for r in results if not r.ok]
    report["first_error"] = errors[0] if errors else None
    return report, [asdict(r) for r in results]


def format_report(rep: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [
        f"{'completed':<28}{rep['completed']}",
        f"{'failed':<28}{rep['failed']}",
        f"{'duration (s)':<28}{rep['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{rep['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{rep['output_throughput']:.2f}",
        f"{'total throughput (tok/s)':<28}{rep['total_token_throughput']:.2f}",
        f"{'goodput (req/s)':<28}{'-' if rep['goodput'] is None else round(rep['goodput'], 2)}",
        f"{'ms':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = rep[f"{name}_ms"]
        lines.append(f"{name.upper():<8}" + "".join(f"{ms(s[k]):>10}" for k in s))
    if rep.get("first_error"):
        lines.append(f"first error: {rep['first_error']}")
    return "\n".join(lines)


def plot_cdfs(results: list[dict], path: str) -> None:
    """Empirical CDFs of TTFT, TPOT, ITL and E2EL (ms) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        ok = [r for r in results if r["ok"]]
        if name == "itl":
            xs = sorted(x for r in ok for x in r["itl_ms"])
        else:
            xs = sorted(r[f"{name}_ms"] for r in ok if r[f"{name}_ms"] is not None)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
        ax.set_title(f"{name.upper()} CDF ({len(xs)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
