"""`pdserve contract`: does a candidate deployment keep the baseline's output contract?

Each contract sends the same requests to both servers (over plain HTTP, to any
OpenAI-compatible endpoint) and either passes or raises `Diff` with the first
difference it found. The gate an operator runs before switching `--runner`, `--mode`
or version; exit status 1 when any contract fails, 2 when it cannot run at all.

Greedy outputs are compared exactly: the same model under greedy decoding must give the
same tokens whatever the batching. Logprob values get a tolerance (see `Cases`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

import httpx

from pdserve.cluster.contract_cases import Cases, load_cases
from pdserve.cluster.endpoint import auth_headers, normalize_base_url, probe_model

SIDES = ("baseline", "candidate")


class Diff(Exception):
    """A contract's first difference (or a failed request), in words."""


def _short(v: object, n: int = 70) -> str:
    s = repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def expect_equal(what: str, a: object, b: object) -> None:
    if a != b:
        if isinstance(a, list) and isinstance(b, list):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            at = f" at [{i}]"
            a, b = (a[i] if i < len(a) else "<end>"), (b[i] if i < len(b) else "<end>")
            what += at
        raise Diff(f"{what}: baseline {_short(a)} vs candidate {_short(b)}")


@dataclass
class Ctx:
    urls: dict[str, str]
    models: dict[str, str]
    headers: dict[str, str]
    cases: Cases
    client: httpx.AsyncClient

    async def post(self, side: str, path: str, **body) -> dict:
        body["model"] = self.models[side]
        try:
            r = await self.client.post(self.urls[side] + path, json=body, headers=self.headers)
        except httpx.HTTPError as e:
            raise Diff(f"{side}: {path} failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            try:
                why = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = r.text[:160]
            raise Diff(f"{side}: {path} answered HTTP {r.status_code}: {why}")
        return r.json()

    async def both(self, path: str = "/v1/completions", **body) -> tuple[dict, dict]:
        a, b = await asyncio.gather(*(self.post(s, path, **dict(body)) for s in SIDES))
        return a, b

    async def stream(self, side: str, **body) -> list[dict | str]:
        """Every SSE event of a streamed completion, parsed; '[DONE]' stays a string."""
        body.update(model=self.models[side], stream=True)
        events: list[dict | str] = []
        url = self.urls[side] + "/v1/completions"
        async with self.client.stream("POST", url, json=body, headers=self.headers) as r:
            if r.status_code != 200:
                raise Diff(f"{side}: stream answered HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
        return events


def _choice(resp: dict) -> dict:
    return resp["choices"][0]


async def greedy(ctx: Ctx) -> str:
    for i, p in enumerate(ctx.cases.prompts):
        a, b = await ctx.both(prompt=p, max_tokens=ctx.cases.max_tokens, temperature=0, logprobs=1)
        expect_equal(
            f"prompt {i} tokens", _choice(a)["logprobs"]["tokens"], _choice(b)["logprobs"]["tokens"]
        )
        expect_equal(f"prompt {i} text", _choice(a)["text"], _choice(b)["text"])
        expect_equal(
            f"prompt {i} finish_reason", _choice(a)["finish_reason"], _choice(b)["finish_reason"]
        )
    return f"{len(ctx.cases.prompts)} prompts, identical tokens"


async def stop_and_eos(ctx: Ctx) -> str:
    c, m = ctx.cases, ctx.cases.max_tokens
    full = _choice(
        await ctx.post(
            "baseline", "/v1/completions", prompt=c.prompts[0], max_tokens=m, temperature=0
        )
    )["text"]
    words = full.split()
    if len(words) < 2:
        raise Diff(f"baseline's greedy text {full!r} is too short to pick a stop string from")
    stop = words[len(words) // 2]
    a, b = await ctx.both(prompt=c.prompts[0], max_tokens=m, temperature=0, stop=[stop])
    for side, r in zip(SIDES, (a, b)):
        want = full[: full.index(stop)]
        if (_choice(r)["text"], _choice(r)["finish_reason"]) != (want, "stop"):
            raise Diff(
                f"{side}: stop {stop!r} gave {_choice(r)['text']!r}, {_choice(r)['finish_reason']!r}; want {want!r}, 'stop'"
            )
    msgs = [{"role": "user", "content": c.eos_question}]
    a, b = await ctx.both("/v1/chat/completions", messages=msgs, max_tokens=64, temperature=0)
    expect_equal("EOS answer", _choice(a)["message"]["content"], _choice(b)["message"]["content"])
    expect_equal("EOS finish_reason", _choice(a)["finish_reason"], _choice(b)["finish_reason"])
    if _choice(b)["finish_reason"] != "stop":
        raise Diff(f"candidate did not end {c.eos_question!r} by EOS in 64 tokens")
    n = b["usage"]["completion_tokens"] + 3
    a, b = await ctx.both(
        "/v1/chat/completions", messages=msgs, max_tokens=n, temperature=0, ignore_eos=True
    )
    for side, r in zip(SIDES, (a, b)):
        got = (_choice(r)["finish_reason"], r["usage"]["completion_tokens"])
        if got != ("length", n):
            raise Diff(f"{side}: ignore_eos with max_tokens={n} gave {got}, want ('length', {n})")
    return f"stop {stop!r} cut both; EOS ends both; ignore_eos runs to max_tokens"


async def max_tokens_length(ctx: Ctx) -> str:
    for i, p in enumerate(ctx.cases.prompts):
        a, b = await ctx.both(prompt=p, max_tokens=3, temperature=0)
        for side, r in zip(SIDES, (a, b)):
            got = (_choice(r)["finish_reason"], r["usage"]["completion_tokens"])
            if got != ("length", 3):
                raise Diff(f"{side}: prompt {i} with max_tokens=3 gave {got}, want ('length', 3)")
    return "finish 'length' with exactly max_tokens tokens"


async def top_logprobs(ctx: Ctx) -> str:
    c, worst = ctx.cases, 0.0
    for i, p in enumerate(c.prompts):
        a, b = await ctx.both(
            prompt=p, max_tokens=c.max_tokens, temperature=0, logprobs=c.top_logprobs
        )
        ta, tb = _choice(a)["logprobs"]["top_logprobs"], _choice(b)["logprobs"]["top_logprobs"]
        expect_equal(f"prompt {i} positions", len(ta), len(tb))
        for j, (ra, rb) in enumerate(zip(ta, tb)):
            expect_equal(
                f"prompt {i} position {j} top-{c.top_logprobs} tokens by rank", list(ra), list(rb)
            )
            for tok in ra:
                d = abs(ra[tok] - rb[tok])
                worst = max(worst, d)
                if d > c.logprob_atol:
                    raise Diff(
                        f"prompt {i} position {j} token {tok!r}: logprob baseline {ra[tok]:.6f} vs candidate {rb[tok]:.6f} (atol {c.logprob_atol})"
                    )
    return f"same top-{c.top_logprobs} by rank; max |diff| {worst:.2e} <= {c.logprob_atol}"


def check_stream_shape(side: str, events: list, max_tokens: int) -> str:
    """The SSE contract: content chunks, one final chunk with finish_reason, one usage
    chunk with no choices, then [DONE]. Returns the streamed text."""
    if not events or events[-1] != "[DONE]":
        raise Diff(f"{side}: stream does not end with [DONE]")
    chunks = events[:-1]
    if any(not isinstance(e, dict) for e in chunks):
        raise Diff(f"{side}: [DONE] appears before the end of the stream")
    if not chunks or chunks[-1].get("choices") or not chunks[-1].get("usage"):
        raise Diff(f"{side}: the last chunk before [DONE] is not a usage chunk with no choices")
    usage, content = chunks[-1]["usage"], chunks[:-1]
    finishes = [ch["choices"][0].get("finish_reason") for ch in content]
    if not content or finishes[-1] != "length" or any(f is not None for f in finishes[:-1]):
        raise Diff(f"{side}: finish reasons in chunk order {finishes}; want None... then 'length'")
    if usage.get("completion_tokens") != max_tokens:
        raise Diff(
            f"{side}: usage flush says {usage.get('completion_tokens')} tokens, want {max_tokens}"
        )
    if usage.get("total_tokens") != usage.get("prompt_tokens", 0) + max_tokens:
        raise Diff(f"{side}: usage total_tokens does not add up: {usage}")
    return "".join(ch["choices"][0].get("text", "") for ch in content)


async def streaming(ctx: Ctx) -> str:
    m = ctx.cases.max_tokens
    body = dict(prompt=ctx.cases.prompts[0], max_tokens=m, temperature=0, ignore_eos=True)
    whole = _choice(await ctx.post("candidate", "/v1/completions", **body))["text"]
    opts = {"include_usage": True}
    ea, eb = await asyncio.gather(*(ctx.stream(s, stream_options=opts, **body) for s in SIDES))
    ta, tb = check_stream_shape("baseline", ea, m), check_stream_shape("candidate", eb, m)
    expect_equal("streamed text", ta, tb)
    if tb != whole:
        raise Diff(f"candidate: streamed text {_short(tb)} != unstreamed {_short(whole)}")
    return f"{len(eb) - 2} content chunks, final chunk, usage flush, [DONE]"


async def n_choices(ctx: Ctx) -> str:
    c = ctx.cases
    a, b = await ctx.both(prompt=c.prompts[0], max_tokens=c.max_tokens, temperature=0, n=c.n)
    for side, r in zip(SIDES, (a, b)):
        idx = [ch["index"] for ch in r["choices"]]
        if idx != list(range(c.n)):
            raise Diff(f"{side}: n={c.n} gave choice indices {idx}")
        if len({ch["text"] for ch in r["choices"]}) != 1:
            raise Diff(f"{side}: greedy n={c.n} choices differ from each other")
    expect_equal("greedy n>1 text", _choice(a)["text"], _choice(b)["text"])
    a, b = await ctx.both(
        prompt=c.prompts[0], max_tokens=c.max_tokens, temperature=1.0, n=c.n, seed=c.seed
    )
    expect_equal(
        f"seeded n={c.n} texts",
        [x["text"] for x in a["choices"]],
        [x["text"] for x in b["choices"]],
    )
    return f"indices 0..{c.n - 1}; greedy and seeded choices match"


async def seeded_sampling(ctx: Ctx) -> str:
    c = ctx.cases
    body = dict(prompt=c.prompts[0], max_tokens=c.max_tokens, temperature=1.0, seed=c.seed)
    first = _choice(await ctx.post("candidate", "/v1/completions", **body))["text"]
    second = _choice(await ctx.post("candidate", "/v1/completions", **body))["text"]
    if first != second:
        raise Diff(f"candidate: seed {c.seed} twice gave {_short(first)} then {_short(second)}")
    base = _choice(await ctx.post("baseline", "/v1/completions", **body))["text"]
    expect_equal(f"seed {c.seed} text", base, first)
    return f"seed {c.seed}: reproducible and equal to baseline"


async def prefix_cache(ctx: Ctx) -> str:
    # A fresh nonce so the first request is a miss even after the other contracts ran.
    prompt = f"[{uuid.uuid4().hex}] " + " ".join(ctx.cases.prompts) * 2
    body = dict(prompt=prompt, max_tokens=ctx.cases.max_tokens, temperature=0)
    miss = await ctx.post("candidate", "/v1/completions", **body)
    hit = await ctx.post("candidate", "/v1/completions", **body)
    if _choice(miss)["text"] != _choice(hit)["text"]:
        raise Diff(
            f"candidate: miss {_short(_choice(miss)['text'])} vs hit {_short(_choice(hit)['text'])}"
        )
    base = await ctx.post("baseline", "/v1/completions", **body)
    expect_equal("long prompt text", _choice(base)["text"], _choice(hit)["text"])
    cached = (hit["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    reported = "not reported" if cached is None else f"{cached} reported"
    return f"miss == hit == baseline (cached tokens on the hit: {reported})"


async def abort_cleanup(ctx: Ctx) -> str:
    c = ctx.cases

    async def burst() -> float:
        t = time.perf_counter()
        prompts = [f"{c.prompts[i % len(c.prompts)]} ({i})" for i in range(c.burst)]
        body = dict(max_tokens=c.max_tokens, temperature=0)
        await asyncio.gather(
            *(ctx.post("candidate", "/v1/completions", prompt=p, **body) for p in prompts)
        )
        return time.perf_counter() - t

    before = await burst()

    async def open_and_close(i: int) -> None:
        body = dict(
            model=ctx.models["candidate"],
            prompt=f"{c.prompts[0]} ({i})",
            max_tokens=512,
            ignore_eos=True,
            stream=True,
        )
        url = ctx.urls["candidate"] + "/v1/completions"
        async with ctx.client.stream("POST", url, json=body, headers=ctx.headers) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream

    await asyncio.wait_for(
        asyncio.gather(*(open_and_close(i) for i in range(c.abort_streams))), 120
    )
    after = await burst()
    # Generous: a shared CPU box varies 2x run to run; a leak of 512-token streams or a
    # wedged scheduler costs far more than 3x (or never finishes: the client times out).
    bound = 3 * before + 2.0
    if after > bound:
        raise Diff(
            f"candidate: burst took {after:.2f} s after {c.abort_streams} aborted streams, {before:.2f} s before (bound {bound:.2f} s)"
        )
    return f"burst {before:.2f} s before, {after:.2f} s after {c.abort_streams} aborts"


CONTRACTS = {
    "greedy": greedy,
    "stop_eos": stop_and_eos,
    "max_tokens_length": max_tokens_length,
    "top_logprobs": top_logprobs,
    "streaming": streaming,
    "n_choices": n_choices,
    "seeded_sampling": seeded_sampling,
    "prefix_cache": prefix_cache,
    "abort_cleanup": abort_cleanup,
}


async def _run_all(ctx: Ctx, names: list[str]) -> dict[str, tuple[bool, str]]:
    results = {}
    for name in names:
        try:
            results[name] = (True, await CONTRACTS[name](ctx))
        except Diff as e:
            results[name] = (False, str(e))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            # A response without the OpenAI fields the contract reads.
            results[name] = (False, f"malformed response: {type(e).__name__}: {e}")
        ok, detail = results[name]
        print(f"{'PASS' if ok else 'FAIL'}  {name:<18} {detail}", flush=True)
    return results


def run_contracts(
    baseline: str, candidate: str, cases_spec: str, api_key: str | None, only: list[str] | None
) -> int:
    cases = load_cases(cases_spec)
    names = list(only or CONTRACTS)
    unknown = [n for n in names if n not in CONTRACTS]
    if unknown:
        raise ValueError(f"unknown contracts {unknown}; known: {list(CONTRACTS)}")
    urls = {"baseline": normalize_base_url(baseline), "candidate": normalize_base_url(candidate)}
    models = {s: probe_model(urls[s], api_key) for s in SIDES}

    async def main() -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            return await _run_all(Ctx(urls, models, auth_headers(api_key), cases, client), names)

    results = asyncio.run(main())
    failed = [n for n, (ok, _) in results.items() if not ok]
    print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0
