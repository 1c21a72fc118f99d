"""`pdserve serve` in a subprocess, used with the official `openai` client.

Two real servers (PD mode with an API key, and colocated, which also answers tool_choice
auto and splits chat replies' reasoning), each a local Ray instance with real workers on
the bundled SmolLM2. Everything goes over HTTP.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_server import KEY, Server

from pdserve.cluster.startup_report import format_startup

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = (
    "You are a helpful assistant for a travel agency. Answer briefly and precisely. "
    "The customer is planning a trip through Europe in the spring and asks about cities. "
)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_chat_answers_and_counts_usage(pd):
    """Guards the whole PD path (prefill worker, ticket, KV pull, decode, ZMQ stream):
    the bundled model's known answer, and usage that adds up."""
    before = pd.metrics()
    r = pd.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20, temperature=0
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens == 8
    text = pd.metrics()
    assert _metric(text, "pdserve:pd_decisions_total", reason="remote_prefill") >= 1
    # The prefill worker wrote the prompt's full blocks behind into the tier actor.
    assert _metric(text, "pdserve:kv_tier_blocks") >= 2
    # Each worker says what it runs: on the CPU no CUDA graphs, every step eager.
    deadline = time.monotonic() + 30
    while _metric(text, "pdserve:engine_steps_total", role="decode", path="eager") < 1:
        assert time.monotonic() < deadline, "the decode worker's steps never reached /metrics"
        time.sleep(0.5)
        text = pd.metrics()
    assert _metric(text, "pdserve:engine_steps_total", path="cuda_graph") == 0
    assert _metric(text, "pdserve:engine_steps_total", path="cuda_graph_whole_step") == 0
    for role in ("prefill", "decode"):
        assert _metric(text, "pdserve:engine_info", role=role, graph_scope="none") == 1, role

    # vLLM's request phases, observed when a request ends (not for one whose client went
    # away): this request's queue (the router's and the prefill worker's waits) and
    # prefill split its TTFT; inference is prefill and decode. Every series carries the
    # model's name.
    def grew(name: str) -> tuple[float, float]:
        return tuple(_metric(text, f"pdserve:{name}_{x}") - _metric(before, f"pdserve:{name}_{x}")
                     for x in ("count", "sum"))  # fmt: skip

    phases = {x: grew(f"request_{x}_time_seconds") for x in ("queue", "prefill", "decode",
                                                              "inference")}  # fmt: skip
    ttft = grew("time_to_first_token_seconds")
    assert {count for count, _ in phases.values()} == {ttft[0]} == {1}, phases
    assert 0 < phases["queue"][1] < ttft[1]
    assert phases["queue"][1] + phases["prefill"][1] == pytest.approx(ttft[1])
    assert phases["prefill"][1] + phases["decode"][1] == pytest.approx(phases["inference"][1])
    samples = [x for x in text.splitlines() if x.startswith("pdserve:")]
    assert all('model_name="SmolLM2-135M-Instruct"' in x for x in samples)


def test_a_local_ray_runs_no_idle_workers(pd):
    """Guards `LOCAL_RAY_SYSTEM_CONFIG`: the server's own Ray runs its workers, tier and
    controller, and no idle Python workers beside them (by default Ray starts one a CPU
    for the first driver, and none of them is ever used here)."""
    titles = sorted(title.split()[0] for title in pd.ray_processes().values())
    # A worker's title is its actor class, with the method it runs and a name prefix
    # while it runs one: `ray::pdserve-tier:TierActor.__init__`.
    classes = {t.removeprefix("ray::").split(":")[-1].split(".")[0] for t in titles}
    assert {"DecodeActor", "PrefillActor", "TierActor"} <= classes, titles
    # The chart's worker pods wait for these processes before `ray stop`
    # (tests/test_helm_stop.py): its pattern must match every pdserve actor's title.
    tpl = (Path(__file__).parents[1] / "helm/pdserve/templates/_workergroup.tpl").read_text()
    pattern = re.search(r'"pattern" "([^"]+)"', tpl).group(1)
    actors = [t for t in titles if re.search(r"(Decode|Prefill|Tier)Actor", t)]
    assert actors and all(re.search(pattern, t) for t in actors), (pattern, actors)
    assert not re.search(pattern, "ray::Controller") and not re.search(pattern, "ray::IDLE")
    assert not [t for t in titles if t.startswith("ray::IDLE")], titles


def test_streamed_equals_unstreamed_with_usage(pd):
    """Guards SSE: chunk order, the final chunk's finish reason, the usage flush, [DONE]."""
    c = pd.client()
    kw = dict(
        model="SmolLM2-135M-Instruct", prompt=LONG + "Name three cities:", max_tokens=24,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_logprobs_completions_and_chat(pd):
    """Guards logprobs plumbing through the ticket (first token) and the stream: k entries
    per position, the sampled token's logprob is the top one under greedy."""
    c = pd.client()
    r = c.completions.create(
        model="SmolLM2-135M-Instruct", prompt=LONG, max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)


def test_return_tokens_as_token_ids_names_each_token_by_id(colocated):
    """Guards vLLM's `return_tokens_as_token_ids`: every token in completions and chat
    logprobs (the chosen one and the top ones) reads "token_id:N", and N decodes to the
    token the plain response names, with the same logprobs."""
    c = colocated.client()
    kw = dict(model="SmolLM2-135M-Instruct", prompt=LONG, max_tokens=4, temperature=0, logprobs=2)
    plain = c.completions.create(**kw).choices[0].logprobs
    ids = c.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True})
    lp = ids.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens), lp.tokens
    as_ids = [int(t.split(":")[1]) for t in lp.tokens]
    detok = httpx.post(
        colocated.url + "/detokenize", json={"model": kw["model"], "tokens": as_ids}, timeout=30
    ).json()["prompt"]
    assert detok == "".join(plain.tokens) and lp.token_logprobs == plain.token_logprobs
    assert all(all(k.startswith("token_id:") for k in top) for top in lp.top_logprobs)
    chat = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    entries = chat.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)


def test_stop_strings_and_n(pd):
    """Guards stop handling (text cut before the stop string, reason "stop") and n=2."""
    c = pd.client()
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=QUESTION,
        max_tokens=20,
        temperature=0,
        stop=["Paris"],
    )
    assert r.choices[0].message.content == "The capital of France is "
    assert r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=8, temperature=0, n=2
    )
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy


def test_seed_reproducible(pd):
    """Guards seeded sampling across prefill and decode workers: same seed, same text."""
    c = pd.client()

    def sample(seed: int) -> str:
        r = c.completions.create(
            model="SmolLM2-135M-Instruct", prompt=LONG, max_tokens=16, temperature=1.0, seed=seed
        )
        return r.choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1
    # A top_k past the vocabulary (past int32 here, which once killed the decode worker's
    # loop) keeps every token, as top_k 0 does: the same sample.
    wide = c.completions.create(
        model="SmolLM2-135M-Instruct", prompt=LONG, max_tokens=16, temperature=1.0, seed=1234,
        extra_body={"top_k": 3_000_000_000},
    )  # fmt: skip
    assert wide.choices[0].text == sample(1234)


def test_32_concurrent_streams(pd):
    """Guards the stream hub under load: 32 interleaved streams each get all their tokens."""

    async def one(client, i: int) -> int:
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=f"{LONG} Request {i}:", max_tokens=12,
            temperature=0, stream=True,
        )  # fmt: skip
        n = 0
        async for ch in stream:
            n += len(ch.choices[0].text) > 0 or ch.choices[0].finish_reason is not None
        return n

    async def main():
        client = openai.AsyncOpenAI(
            base_url=pd.url + "/v1", api_key=KEY, max_retries=0, timeout=300
        )
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    counts = asyncio.run(main())
    assert all(n >= 2 for n in counts), counts


def test_pd_equals_colocated_greedy(pd, colocated):
    """Guards disaggregation's promise: PD and colocated give identical greedy outputs."""
    prompts = [LONG + f"Tell me about city number {i}." for i in range(4)]
    for p in prompts:
        a = pd.client().completions.create(
            model="SmolLM2-135M-Instruct", prompt=p, max_tokens=16, temperature=0
        )
        b = colocated.client().completions.create(
            model="SmolLM2-135M-Instruct", prompt=p, max_tokens=16, temperature=0
        )
        assert a.choices[0].text == b.choices[0].text
    assert _metric(colocated.metrics(), "pdserve:pd_decisions_total", reason="colocated") >= 4


def test_shared_prefix_shows_prefix_hits(colocated):
    """Guards prefix caching behind the router: a second request sharing a long prefix
    must be counted as hits in /metrics."""
    before = _metric(colocated.metrics(), "pdserve:prefix_cache_hits_total")
    c = colocated.client()
    for tail in ("First question?", "Second question?"):
        c.completions.create(
            model="SmolLM2-135M-Instruct", prompt=LONG * 3 + tail, max_tokens=2, temperature=0
        )
    assert _metric(colocated.metrics(), "pdserve:prefix_cache_hits_total") - before >= 64


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"prompt": 5, "max_tokens": 3}', 400, "prompt"),
        (b'{"prompt": "hi", "max_tokens": "3"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "hi", "model": "gpt-17"}', 404, "does not exist"),
        (b'{"prompt": [5, 49152], "max_tokens": 2}', 400, "vocabulary"),
        (b'{"prompt": [5, 1099511627776], "max_tokens": 2, "echo": true}', 400, "vocabulary"),
        (json.dumps({"prompt": "word " * 1100, "max_tokens": 4}).encode(), 400, "context length"),
        # Integers msgpack cannot carry to a worker were a 500 (fuzzing found them).
        (b'{"prompt": "hi", "max_tokens": 2, "top_k": 1000000000000000000000}', 400, "top_k"),
        (b'{"prompt": "hi", "max_tokens": 2, "seed": 1000000000000000000000}', 400, "seed"),
        (
            b'{"prompt": "hi", "max_tokens": 2, "stop_token_ids": [1000000000000000000000]}',
            400,
            "stop_token_ids",
        ),
        (b'{"prompt": "hi", "max_tokens": 2, "n": 129}', 400, "'n' must be at most 128"),
    ],
)
def test_bad_input_gets_openai_errors(colocated, body, status, fragment):
    """Guards the edge: each bad request gets the OpenAI error shape and a 4xx, and the
    server keeps serving (checked by every later test on the same server)."""
    r = httpx.post(
        colocated.url + "/v1/completions", content=body,
        headers={"content-type": "application/json"}, timeout=30,
    )  # fmt: skip
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and fragment in err["message"]
    assert r.headers["x-request-id"].startswith("req-")


def test_truncate_prompt_tokens_keeps_the_prompts_end(colocated):
    """Guards `truncate_prompt_tokens`: a prompt longer than the context runs on its last k
    tokens (charged k), answers as those k tokens sent alone do, and echo shows the
    kept text."""
    c = colocated.client()
    long_prompt = "word " * 1100 + "The capital of France is"
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=6, temperature=0)
    cut = c.completions.create(
        prompt=long_prompt, echo=True, extra_body={"truncate_prompt_tokens": 24}, **kw
    )
    assert cut.usage.prompt_tokens == 24
    kept = httpx.post(
        colocated.url + "/tokenize", json={"model": kw["model"], "prompt": long_prompt},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
    ).json()["tokens"][-24:]  # fmt: skip
    alone = c.completions.create(prompt=kept, echo=True, **kw)
    # Echo shows the kept tokens' text, then the answer: the same for both requests.
    assert cut.choices[0].text == alone.choices[0].text
    assert "word The capital of France is" in cut.choices[0].text
    assert cut.choices[0].text.count("word") < 24, cut.choices[0].text


def test_body_limits_and_gzip_bomb(colocated):
    """Guards memory: an oversized body and a gzip bomb (5 MB of zeros in 5 kB) are
    refused with 413 without inflating past the limit."""
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(colocated.url + "/v1/completions", content=big, timeout=60)
    assert r.status_code == 413
    bomb = gzip.compress(b'{"prompt": "' + b"0" * (5 << 20) + b'"}')
    assert len(bomb) < 16_000
    r = httpx.post(
        colocated.url + "/v1/completions", content=bomb,
        headers={"content-encoding": "gzip", "content-type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 413 and "decompressed" in r.json()["error"]["message"]
    ok = httpx.post(
        colocated.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200


def test_prefix_cached_on_decode_prefills_locally(pd):
    """Guards conditional disaggregation: a prompt whose prefix the decode worker already
    has is not shipped to a prefill worker (counted as prefix_hit_on_decode), and the
    answer is the same either way."""
    c = pd.client()
    prompt = LONG * 3 + "Which river runs through Paris?"

    def ask() -> str:
        # min_tokens: SmolLM2 ends this prompt at its first token, which leaves the KV on
        # the prefill worker (the next test); here the decode worker must pull it.
        r = c.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"min_tokens": 4},
        )  # fmt: skip
        return r.choices[0].text

    before = pd.metrics()
    first, second = ask(), ask()
    after = pd.metrics()

    def delta(reason: str) -> float:
        name = "pdserve:pd_decisions_total"
        return _metric(after, name, reason=reason) - _metric(before, name, reason=reason)

    assert first == second
    assert delta("remote_prefill") == 1 and delta("prefix_hit_on_decode") == 1


def test_a_reply_that_ends_at_its_first_token_leaves_no_prefix_on_decode(pd):
    """Guards the router's prefix index: a remotely prefilled request whose first token
    ends it (max_tokens 1, as in classification loads) leaves its KV on the prefill
    worker, never pulled, so the same prompt again goes to the prefill worker (which hits
    its cache) rather than to the decode worker as a prefix hit it would compute whole
    (before: prefix_hit_on_decode, and the decode worker computed every prompt token)."""
    c = pd.client()
    prompt = LONG * 3 + "Which bridge in Paris is the oldest?"

    def ask():
        return c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1,
                                    temperature=0)  # fmt: skip

    before = pd.metrics()
    first, second = ask(), ask()
    after = pd.metrics()

    def delta(name: str, **labels) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    decisions = "pdserve:pd_decisions_total"
    assert delta(decisions, reason="remote_prefill") == 2
    assert delta(decisions, reason="prefix_hit_on_decode") == 0
    computed = "pdserve:worker_prompt_tokens_computed_total"
    assert delta(computed, role="decode") == 0
    assert delta(computed, role="prefill") < 2 * first.usage.prompt_tokens  # a hit there
    assert first.choices[0].text == second.choices[0].text
    # The prefill worker's hit is the request's cached tokens (its ticket carries them; 0
    # before). The first may hit too: other tests' prompts share its opening.
    cached = [(r.usage.prompt_tokens_details.cached_tokens or 0) if r.usage.prompt_tokens_details
              else 0 for r in (first, second)]  # fmt: skip
    assert cached[1] >= max(64, cached[0]), cached


def test_a_requests_choices_compute_its_prompt_once(pd):
    """The n=4 choices of a request on the PD path: one computes the prompt on the prefill
    worker; the other three hit its blocks (arriving in the same step they wait for them,
    runner/prefix_sharing.py, whose engine tests pin that case; arriving later they find
    them cached), so the worker computes the prompt once plus three tails of under a block
    each. Each choice reports the hit as its cached tokens."""
    prompt = "Tell me four facts about lighthouses on rocky coasts. " + LONG * 6
    before = pd.metrics()
    r = pd.client().completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                       max_tokens=4, n=4, temperature=1.0, seed=5)  # fmt: skip
    after = pd.metrics()

    def delta(name: str, **labels) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    n_prompt = r.usage.prompt_tokens  # a request's prompt is counted once, whatever its n
    assert len(r.choices) == 4 and n_prompt > 150
    assert delta("pdserve:pd_decisions_total", reason="remote_prefill") == 4
    computed = delta("pdserve:worker_prompt_tokens_computed_total", role="prefill")
    assert computed < n_prompt + 3 * 16, (computed, n_prompt)
    assert r.usage.prompt_tokens_details.cached_tokens >= n_prompt - 16


def test_cache_salt_keeps_prefix_hits_within_one_salt(pd):
    """Guards vLLM's `cache_salt` end to end (it was ignored, so tenants hit, and could
    time, each other's prompts): a prompt cached unsalted is a miss under a salt, on the
    workers and in the router's index (sent to a prefill worker, not prefilled on the
    decode worker as a hit); the same salt hits it the second time, another salt does
    not; the answers agree; an empty or non-string salt is a 400 naming it."""
    c = pd.client()
    prompt = LONG * 3 + "Which museum in Paris holds the Mona Lisa?"

    def ask(salt: str | None):
        # min_tokens: each reply decodes on the decode worker, whose cache a2 must hit
        # (SmolLM2 may end this one at its first token, sampled by the prefill worker).
        return c.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4, temperature=0,
            extra_body={"min_tokens": 4, **({"cache_salt": salt} if salt is not None else {})},
        )  # fmt: skip

    def cached(r) -> int:
        details = r.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0

    plain = ask(None)
    before = pd.metrics()
    a1, a2, b1 = ask("tenant-a"), ask("tenant-a"), ask("tenant-b")
    after = pd.metrics()
    assert [cached(r) for r in (a1, b1)] == [0, 0], (a1.usage, b1.usage)
    assert cached(a2) >= 64, a2.usage
    assert plain.choices[0].text == a1.choices[0].text == a2.choices[0].text == b1.choices[0].text

    def delta(reason: str) -> float:
        name = "pdserve:pd_decisions_total"
        return _metric(after, name, reason=reason) - _metric(before, name, reason=reason)

    assert delta("remote_prefill") == 2 and delta("prefix_hit_on_decode") == 1
    for bad in ("", 5):
        r = httpx.post(
            pd.url + "/v1/chat/completions",
            json={"messages": QUESTION, "max_tokens": 2, "cache_salt": bad},
            headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
        )  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt", r.text


def test_logit_bias_allowed_ids_and_bad_words_hold_from_the_first_token_in_pd(pd, smollm_dir):
    """Guards logit_bias, allowed_token_ids and bad_words over HTTP in PD mode: the first
    token, sampled on the prefill worker (a remote prefill), follows the bias the wire
    carried, and so do the decode worker's; a two-token bad word is banned across the
    hand-over; allowed ids hold a random chat answer; ids past the vocabulary and
    malformed words are a 400 naming the field."""
    from pdserve.runner.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm_dir)
    paris, comma = (tok(w, add_special_tokens=False).input_ids for w in (" Paris", ","))
    assert len(paris) == len(comma) == 1
    c = pd.client()
    before = pd.metrics()
    r = c.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Logit bias check. " + LONG * 2 + "My city is",
        max_tokens=4, temperature=0, logit_bias={str(paris[0]): 100},
    )  # fmt: skip
    name = "pdserve:pd_decisions_total"
    assert (
        _metric(pd.metrics(), name, reason="remote_prefill")
        - _metric(before, name, reason="remote_prefill")
        == 1
    )
    assert r.choices[0].text == " Paris" * 4
    # bad_words on the same route: " Paris" may not follow " Paris", so the biased
    # answer alternates with the next-favoured ","; the decode worker's second token
    # reads the prefill worker's first as output, not prompt.
    r = c.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Bad words check. " + LONG * 2 + "My city is",
        max_tokens=4, temperature=0, logit_bias={str(paris[0]): 100, str(comma[0]): 50},
        extra_body={"bad_words": ["Paris Paris"]},
    )  # fmt: skip
    assert r.choices[0].text == " Paris, Paris,"
    after = _metric(pd.metrics(), name, reason="remote_prefill")
    assert after - _metric(before, name, reason="remote_prefill") == 2
    chat = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=6, temperature=1.0,
        seed=3, extra_body={"allowed_token_ids": paris + comma},
    )  # fmt: skip
    text = chat.choices[0].message.content
    assert text and text.replace(" Paris", "").replace(",", "") == "", text
    for extra, param in (
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"allowed_token_ids": [5, 10**9]}, "allowed_token_ids"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"bad_words": ["fine", " "]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(
                model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2, extra_body=extra
            )
        assert e.value.body.get("param") == param, e.value.body


def test_structured_output_over_http_in_pd_equals_colocated(pd, colocated):
    """Guards structured output through the router and both PD workers: the prefill
    worker samples the first token under the schema and the decode worker continues from
    the state that token leads to, so PD's greedy answer equals colocated's and validates;
    JSON mode and a choice hold over chat; a bad constraint is a 400 naming its field."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    msgs = [{"role": "user", "content": LONG + "Name one large city and its population."}]
    before = _metric(pd.metrics(), "pdserve:pd_decisions_total", reason="remote_prefill")
    texts = []
    for server in (pd, colocated):
        r = server.client().chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=40, temperature=0,
            response_format=fmt,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content)
    after = _metric(pd.metrics(), "pdserve:pd_decisions_total", reason="remote_prefill")
    assert after - before == 1  # the PD answer's first token came from the prefill worker
    assert texts[0] == texts[1]
    jsonschema.validate(json.loads(texts[0]), schema)
    text = colocated.metrics()
    assert _metric(text, "pdserve:worker_structured_requests_total") >= 1, text
    assert _metric(text, "pdserve:worker_grammar_compiles_total") >= 1
    assert _metric(text, "pdserve:worker_grammar_compile_seconds_total") > 0
    c = pd.client()
    # The README's example, answer and all.
    place = {"type": "object", "required": ["city", "country"],
             "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}  # fmt: skip
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
        messages=[{"role": "user",
                   "content": "Which city is the capital of France? Answer as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "place", "schema": place}},
    )  # fmt: skip
    assert r.choices[0].message.content == '{"city": "Paris", "country": "FRANCE"}'
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=60, temperature=0.7,
        seed=5, response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(
        model="SmolLM2-135M-Instruct", prompt=LONG + "The best season to visit Rome is",
        max_tokens=5, temperature=1.0, n=3, seed=2,
        extra_body={"structured_outputs": {"choice": [" spring", " summer", " autumn"]}},
    )  # fmt: skip
    assert {ch.text for ch in r.choices} <= {" spring", " summer", " autumn"}
    # A GBNF grammar, under both of vLLM's names: the same greedy answer, in its language.
    grammar = 'root ::= "The answer is " num "."\nnum ::= [0-9] | [1-9] [0-9]+'
    texts = [c.completions.create(
        model="SmolLM2-135M-Instruct", prompt=LONG + "How many days are in a week?",
        max_tokens=12, temperature=0, extra_body=extra,
    ).choices[0].text for extra in ({"structured_outputs": {"grammar": grammar}},
                                   {"guided_grammar": grammar})]  # fmt: skip
    assert texts[0] == texts[1] and re.fullmatch(r"The answer is (\d|[1-9]\d+)\.", texts[0])
    # vLLM's structural tag: the free answer until its trigger, then the structure.
    country = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 12}},
               "required": ["country"], "additionalProperties": False}  # fmt: skip
    tag = {"type": "structural_tag", "triggers": ["Paris"],
           "structures": [{"begin": "Paris", "schema": country, "end": "."}]}  # fmt: skip
    r = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=30, temperature=0,
        response_format=tag,
    )  # fmt: skip
    head, paris, rest = r.choices[0].message.content.partition("Paris")
    assert head == "The capital of France is " and paris and rest.endswith("."), rest
    jsonschema.validate(json.loads(rest[:-1]), country)
    for extra, param in (
        ({"guided_regex": "a{2,1}"}, "guided_regex"),
        # Parses, but its automaton would need more than 20,000 states (compiled on a thread).
        ({"guided_regex": "(a|b)*a(a|b){16}"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "string", "format": "ipv9"}}}}, "response_format"),
        ({"guided_grammar": "root ::= 'a' rest"}, "guided_grammar"),  # rest is not defined
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(
                model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2, extra_body=extra
            )
        assert e.value.body.get("param") == param, e.value.body


def test_beam_search_over_http_equals_the_offline_search(pd, colocated, smollm_dir):
    """Guards `use_beam_search` through the router (every beam's one-token asks routed as
    requests, PD included): the choices are the offline search's beams (itself checked
    against transformers, tests/test_beam_search.py), best first, on both servers; chat
    takes it too; what the search would not carry out is a 400 naming the field."""
    from pdserve import LLM, BeamSearchParams

    llm = LLM(model=smollm_dir, device="cpu", dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=16 << 20)  # fmt: skip
    ids = llm.get_tokenizer()("The capital of France is").input_ids
    (want,) = llm.beam_search([{"prompt_token_ids": ids}],
                              BeamSearchParams(3, 6, length_penalty=0.5))  # fmt: skip
    want_choices = [(i, s.text, s.finish_reason) for i, s in enumerate(want.sequences)]
    kw = dict(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=6, n=3, temperature=0,
              extra_body={"use_beam_search": True, "length_penalty": 0.5})  # fmt: skip
    for server in (pd, colocated):
        r = server.client().completions.create(**kw)
        assert [(c.index, c.text, c.finish_reason) for c in r.choices] == want_choices
        assert r.usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)
    r = pd.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=10, n=2,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    texts = [c.message.content for c in r.choices]
    assert len(texts) == 2 and len(set(texts)) == 2 and all(texts), texts
    # The colocated server reads chat replies (qwen3 reasoning, hermes calls under auto):
    # a beam goes through the same reading (SmolLM2 writes neither, so the text stays).
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    r = colocated.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=10, n=2, tools=tools,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert [c.message.content for c in r.choices] == texts
    assert all(c.message.tool_calls is None for c in r.choices)
    c = pd.client()
    for extra, param in (
        ({"use_beam_search": True, "stream": True}, "stream"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "stop": ["."]}, "stop"),
        ({"use_beam_search": True, "n": 11}, "n"),
        ({"use_beam_search": True, "guided_regex": "a+"}, "guided_regex"),
        ({"length_penalty": 2.0}, "length_penalty"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2,
                                 extra_body=extra)  # fmt: skip
        assert e.value.body.get("param") == param, e.value.body


def test_tool_calls_named_and_required_over_http(pd):
    """Guards tool calling through the router and both PD workers: a named function comes
    back as one tool call whose arguments validate against its parameters (streamed, the
    same arguments in pieces), `required` as one or more calls of the given tools (streamed,
    call by call, the same calls), `none`
    as text; `auto` is refused by name rather than answered with text."""
    import jsonschema

    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    }  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": params}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]
    c = pd.client()
    kw = dict(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=40, temperature=0,
              tools=tools)  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(**kw, tool_choice=named)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), params)
    pieces, names, finish = [], set(), None
    for chunk in c.chat.completions.create(**kw, tool_choice=named, stream=True):
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                pieces.append(tc.function.arguments or "")
                names.add(tc.function.name)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == call.function.arguments and finish == "tool_calls"
    assert names - {None} == {"get_weather"}
    r = c.chat.completions.create(**kw, tool_choice="required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
    for tc in ch.message.tool_calls:
        assert tc.function.name in ("get_weather", "get_time")
        args = json.loads(tc.function.arguments)
        jsonschema.validate(
            args, params if tc.function.name == "get_weather" else {"type": "object"}
        )
    # Streamed, each call goes out as it comes; joined, the same calls.
    whole = [(tc.function.name, tc.function.arguments) for tc in ch.message.tool_calls]
    assert _streamed_chat(c, **kw, tool_choice="required") == ("", whole, "tool_calls")
    r = c.chat.completions.create(**kw, tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # A tool whose parameters use a keyword structured output does not carry out: a 400
    # naming `tools` from the router (before, it reached the workers).
    bounded = {"type": "object", "properties": {"days": {"type": "integer", "multipleOf": 7}}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**{**kw, "tools": [{"type": "function", "function": {
            "name": "forecast", "parameters": bounded}}]}, tool_choice="required")  # fmt: skip
    assert e.value.body.get("param") == "tools" and "multipleOf" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**kw)  # tool_choice auto, OpenAI's default with tools
    assert e.value.body.get("param") == "tool_choice"
    # vLLM's words, which clients look for; this server has neither flag.
    assert e.value.body["message"].startswith(
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
    )


def _streamed_chat(client: openai.OpenAI, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat's joined content, its tool calls as (name, arguments) and its last
    finish reason; each call's first delta must carry its id and type."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function", tc
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_choice_auto_reads_hermes_calls_over_http(colocated):
    """Guards tool_choice auto through the real router (the colocated server runs with
    --enable-auto-tool-choice --tool-call-parser hermes). SmolLM2's chat template ignores
    tools and the model answers in text: the reply equals the one without tools, with no
    tool_calls, streamed and whole alike. A reply that structured output forces into a
    hermes block comes back as that call (content null, finish_reason tool_calls), the
    same streamed. The parser reads only what the model generated, as vLLM's does: a
    block the client opened with continue_final_message is not completed into a call."""
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time"}},
    ]  # fmt: skip
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kw = dict(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=30, temperature=0)
    c = colocated.client()
    plain = c.chat.completions.create(**kw).choices[0]
    auto = c.chat.completions.create(**kw, tools=tools).choices[0]  # auto: the default
    assert auto.message.content and auto.message.content == plain.message.content
    assert auto.message.tool_calls is None
    assert auto.finish_reason == plain.finish_reason and auto.finish_reason in ("stop", "length")
    streamed = _streamed_chat(c, **kw, tools=tools, tool_choice="auto")
    assert streamed == (auto.message.content, [], auto.finish_reason)

    city = "[A-Z][a-z]{2,8}"
    call_rx = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "' + city +
        r'"\}\}\n</tool_call>'
    )  # fmt: skip
    forced = dict(
        kw, max_tokens=60, tools=tools, extra_body={"structured_outputs": {"regex": call_rx}}
    )
    r = c.chat.completions.create(**forced).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None, r
    (call,) = r.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert re.fullmatch(city, json.loads(call.function.arguments)["city"]), call
    got = _streamed_chat(c, **forced)
    assert got == ("", [("get_weather", call.function.arguments)], "tool_calls")

    began = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    go_on = dict(kw, messages=[*msgs, {"role": "assistant", "content": began}], tools=tools,
                 extra_body={"continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    rest = c.chat.completions.create(**go_on, tool_choice="auto").choices[0]
    as_text = c.chat.completions.create(**go_on, tool_choice="none").choices[0]
    assert rest.message.tool_calls is None and rest.message.content == as_text.message.content


def _streamed_reasoning(client: openai.OpenAI, **kw) -> tuple[str, str, list, str]:
    """A streamed chat's joined reasoning and content, its tool calls as (name, arguments),
    its last finish reason; every reasoning delta must come before the first content."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            piece = (choice.delta.model_extra or {}).get("reasoning")
            if piece:
                assert not content, (content, piece)  # thinking, then answering
                reasoning += piece
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments
            finish = choice.finish_reason or finish
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_reasoning_parser_splits_thinking_over_http(colocated):
    """Guards --reasoning-parser through the real router (the colocated server runs with
    --reasoning-parser qwen3). SmolLM2 does not think: its reply is plain content, reasoning
    null, the raw text /v1/completions gives for the same prompt. A reply that structured
    output forces into `<think>...</think>` comes back split, reasoning the block's text and
    content the answer, streamed alike (reasoning deltas, then content), while completions
    keep the raw text. With tool_choice auto the hermes parser reads only the answer (a
    think block, then a call: the call); a named tool choice still comes back as its call."""
    kw = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0)
    ids = httpx.post(colocated.url + "/tokenize", json={"messages": QUESTION},
                     timeout=30).json()["tokens"]  # fmt: skip
    c = colocated.client()

    def raw(**extra) -> str:  # the same prompt and decoding, unparsed
        return c.completions.create(model=kw["model"], prompt=ids, temperature=0,
                                    **extra).choices[0].text  # fmt: skip

    r = httpx.post(colocated.url + "/v1/chat/completions", json={**kw, "max_tokens": 12},
                   timeout=120).json()["choices"][0]  # fmt: skip
    plain, finish = r["message"]["content"], r["finish_reason"]
    assert r["message"]["reasoning"] is None and plain == raw(max_tokens=12)
    assert _streamed_reasoning(c, **kw, max_tokens=12) == ("", plain, [], finish)

    think = "<think>[a-z ]{1,30}</think>\n?[A-Za-z ]{1,30}"
    forced = dict(kw, max_tokens=100, extra_body={"structured_outputs": {"regex": think}})
    r = c.chat.completions.create(**forced).choices[0]
    reasoning = r.message.model_extra["reasoning"]
    assert r.finish_reason == "stop", r
    assert re.fullmatch("[a-z ]{1,30}", reasoning), r
    assert re.fullmatch("[A-Za-z ]{1,30}", r.message.content), r
    text = raw(max_tokens=100, extra_body=forced["extra_body"])
    assert text in (f"<think>{reasoning}</think>{r.message.content}",
                    f"<think>{reasoning}</think>\n{r.message.content}"), text  # fmt: skip
    assert _streamed_reasoning(c, **forced) == (reasoning, r.message.content, [], "stop")

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}}}]  # fmt: skip
    call_rx = (
        r'<think>[a-z ]{1,30}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
    )
    auto = dict(forced, tools=tools, extra_body={"structured_outputs": {"regex": call_rx}})
    r = c.chat.completions.create(**auto).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content is None, r
    (call,) = r.message.tool_calls
    reasoning = r.message.model_extra["reasoning"]
    assert re.fullmatch("[a-z ]{1,30}", reasoning) and call.function.name == "get_weather"
    got = _streamed_reasoning(c, **auto)
    assert got == (reasoning, "", [("get_weather", call.function.arguments)], "tool_calls")

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(**kw, max_tokens=40, tools=tools, tool_choice=named).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.model_extra["reasoning"] is None, r
    (call,) = r.message.tool_calls
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    got = _streamed_reasoning(c, **kw, max_tokens=40, tools=tools, tool_choice=named)
    assert got == ("", "", [("get_weather", call.function.arguments)], "tool_calls")

    # A prompt that ends inside an open `<think>` (as Qwen3 Thinking-2507's template writes
    # it): the reply, which SmolLM2 does not close, is all reasoning, content null.
    opened = [*QUESTION, {"role": "assistant", "content": "<think>\n"}]
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    ids = httpx.post(colocated.url + "/tokenize", json={"messages": opened, **go_on},  # raw's
                     timeout=30).json()["tokens"]  # fmt: skip
    text = raw(max_tokens=12)
    assert "</think>" not in text and text, text
    inside = dict(kw, messages=opened, max_tokens=12, extra_body=go_on)
    r = c.chat.completions.create(**inside).choices[0]
    assert (r.message.model_extra["reasoning"], r.message.content) == (text, None), r
    assert _streamed_reasoning(c, **inside) == (text, "", [], r.finish_reason)


def test_include_reasoning_false_drops_the_thinking(colocated):
    """Guards vLLM's `include_reasoning: false`: a reply forced into a think block comes
    back as its answer only, reasoning null, and a stream sends no reasoning delta; the
    answer is the same as with the thinking returned."""
    c = colocated.client()
    think = {"regex": "<think>[a-z ]{1,30}</think>\n?[A-Za-z ]{1,30}"}
    kw = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=100)
    shown = c.chat.completions.create(**kw, extra_body={"structured_outputs": think})
    assert shown.choices[0].message.model_extra["reasoning"], shown
    hidden = {"structured_outputs": think, "include_reasoning": False}
    r = c.chat.completions.create(**kw, extra_body=hidden).choices[0]
    assert r.message.model_extra["reasoning"] is None
    assert r.message.content == shown.choices[0].message.content
    assert _streamed_reasoning(c, **kw, extra_body=hidden) == ("", r.message.content, [], "stop")


def test_chat_echo_joins_the_answer_the_client_began(pd):
    """Guards chat `echo` (vLLM's): with `continue_final_message` the reply starts with the
    assistant words the client sent, followed by exactly what the same request without
    echo generates (same usage, logprobs for those tokens only); streamed deltas join to the same content under one role
    chunk; a last message of another role is not echoed; with `add_generation_prompt:
    false` the reply takes the last message's role and echoes it."""
    c = pd.client()
    began = "The capital of France is"
    messages = [*QUESTION, {"role": "assistant", "content": began}]
    go_on = {"continue_final_message": True, "add_generation_prompt": False}
    kw = dict(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=6, temperature=0)
    plain = c.chat.completions.create(**kw, extra_body=go_on)
    echoed = c.chat.completions.create(**kw, logprobs=True, extra_body={**go_on, "echo": True})
    rest = plain.choices[0].message.content
    assert rest and echoed.choices[0].message.content == began + rest
    assert echoed.choices[0].message.role == "assistant"
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    # Logprobs are the generated tokens' only: the echo is text, as in vLLM.
    assert len(echoed.choices[0].logprobs.content) == echoed.usage.completion_tokens
    chunks = list(c.chat.completions.create(**kw, stream=True, extra_body={**go_on, "echo": True}))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert [d.role for d in deltas if d.role] == ["assistant"]
    assert "".join(d.content or "" for d in deltas) == began + rest
    asked = c.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=4, temperature=0,
        extra_body={"echo": True},
    )  # fmt: skip
    assert not asked.choices[0].message.content.startswith(QUESTION[0]["content"])
    r = httpx.post(
        pd.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
        json={"messages": QUESTION, "max_tokens": 2, "temperature": 0, "echo": True,
              "add_generation_prompt": False},
    )  # fmt: skip
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith(QUESTION[0]["content"])


@pytest.fixture(scope="module")
def pd_busy(tmp_path_factory):
    # Conditional disaggregation at its tightest: one prompt token in flight on the prefill
    # worker is "backed up", so prompts arriving meanwhile prefill on the decode worker.
    # It also logs every request, prints the pools' stats every second, and moves KV over
    # the nccl transport (on the CPU the same P2P code path over gloo; the two-GPU run is
    # #7's), and schedules by priority. One server for the four: each start costs CI
    # ~40-60 s.
    server = Server(
        tmp_path_factory.mktemp("busy"), "--pd-max-prefill-queue-tokens", "1",
        "--enable-log-requests", "--log-stats-interval", "1", "--kv-transport", "nccl",
        "--max-model-len", "1024", "--scheduling-policy", "priority",
    )  # fmt: skip
    yield server
    server.stop()


def test_backed_up_prefill_pool_sends_prompts_to_the_decode_worker(pd_busy, pd):
    """Guards `--pd-max-prefill-queue-tokens`: of prompts sent together, those arriving
    while the prefill worker is busy prefill on the decode worker (counted as
    prefill_busy), the first still goes remote, and every answer equals the one the
    default PD server gives the same prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    cities = ("Lisbon", "Vienna", "Prague", "Dublin", "Oslo", "Madrid")
    # The city comes first: no two prompts share a cached block, so none is a prefix hit.
    prompts = [f"Name one museum in {city}. {LONG}" for city in cities]

    def ask(server: Server, prompt: str) -> str:
        r = server.client().completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0
        )
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: ask(pd_busy, p), prompts))
    alone = [ask(pd, p) for p in prompts]
    assert together == alone
    text = pd_busy.metrics()
    name = "pdserve:pd_decisions_total"
    assert _metric(text, name, reason="prefill_busy") >= 1
    assert _metric(text, name, reason="remote_prefill") >= 1


def _log_lines(server: Server, needle: str, count: int = 1, timeout_s: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [ln for ln in server.log.read_text().splitlines() if needle in ln]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def test_a_clients_request_id_names_the_request(pd_busy):
    """vLLM's request ids: the client's X-Request-Id header (an operator's gateway sets one
    to trace a request), else the body's `request_id`, names the response (`chatcmpl-<id>`,
    every chunk of a stream too), comes back in the header and is what the request log
    says, so the gateway's id finds the server's lines. Ids that could break a log line
    are a 400; the server keeps its own id when none is given."""
    url = pd_busy.url
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3, "temperature": 0}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json={**body, "request_id": "body-1"},
                   headers={"X-Request-Id": "trace-42"}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-trace-42"
    assert r.headers["x-request-id"] == "trace-42"
    assert _log_lines(pd_busy, "request chatcmpl-trace-42: finished")
    r = httpx.post(url + "/v1/completions", json={"model": body["model"], "prompt": "Hi",
                   "max_tokens": 2, "stream": True, "request_id": "job.7"}, timeout=60)  # fmt: skip
    ids = {json.loads(x[6:])["id"] for x in r.text.splitlines() if x.startswith("data: {")}
    assert ids == {"cmpl-job.7"}
    assert r.headers["x-request-id"].startswith("req-")  # no header: the server's own
    for headers, extra, where in (
        ({"X-Request-Id": "a b"}, {}, "X-Request-Id"),
        ({}, {"request_id": "x\ninjected line"}, "'request_id'"),
        ({}, {"request_id": 7}, "'request_id'"),
        ({"X-Request-Id": "z" * 129}, {}, "X-Request-Id"),
    ):
        r = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, headers=headers,
                       timeout=60)  # fmt: skip
        assert r.status_code == 400 and where in r.json()["error"]["message"], r.text
    assert "injected line" not in pd_busy.log.read_text()


def test_the_log_says_where_each_request_ran_and_what_the_pools_did(pd_busy):
    """Guards `--enable-log-requests` and the stats lines: a long prompt alone is prefilled
    on the prefill worker, a short one with n=2 on the decode worker, both choices logged;
    a client that hangs up is logged as gone; the pools' lines report the work, and the
    workers' token counters add up to the router's."""
    client = pd_busy.client()
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Name one bridge in Porto. " + LONG,
        max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    received, routed, finished = (
        _log_lines(pd_busy, f"request {r.id}{what}")
        for what in (": received", " choice ", ": finished")
    )
    prompt_tokens = r.usage.prompt_tokens
    assert received[0].endswith(
        f"received completion, {prompt_tokens} prompt tokens; max_tokens=6, temperature=0.0, "
        "ignore_eos=True"
    ), received
    assert "remote_prefill, prompt on prefill-0, decode on decode-0" in routed[0]
    assert ": finished (length), 6 output tokens, TTFT " in finished[0]

    short = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=3, n=2, temperature=0.5,
        stream=True,
    )  # fmt: skip
    api_id = next(iter(short)).id
    for _ in short:
        pass
    routed = _log_lines(pd_busy, f"request {api_id} choice ", 2)
    assert sorted(line.split(" choice ")[1][0] for line in routed) == ["0", "1"]
    assert all("short_prompt, prompt on the decode worker, decode on decode-0" in x for x in routed)
    assert ", stream; max_tokens=3, temperature=0.5, n=2" in _log_lines(pd_busy, api_id)[0]

    # Every worker's sampled tokens reach the router: the first ones on the prefill worker
    # (remote prefills) or the decode worker, the rest on the decode worker.
    text = pd_busy.metrics()
    workers = _metric(text, "pdserve:worker_generation_tokens_total")
    assert workers == _metric(text, "pdserve:generation_tokens_total") > 0
    assert _metric(text, "pdserve:worker_prompt_tokens_computed_total", role="prefill") > 0
    # The decode worker's lease keeper is exported (how many it extended depends on timing).
    labels = '{model_name="SmolLM2-135M-Instruct",role="decode",worker="decode-0"}'
    assert "pdserve:kv_lease_extensions_total" + labels in text
    assert "pdserve:kv_lease_extension_failures_total" + labels in text
    # One series per worker; on the CPU nothing is compiled (Triton runs on a GPU only).
    compiles = [x for x in text.splitlines() if x.startswith("pdserve:worker_kernel_compiles")]
    assert len(compiles) == 2 and all(x.endswith(" 0.0") for x in compiles), compiles

    # Each worker's startup line (weights, KV room, graphs), with what /ops/pools reports.
    pools = httpx.get(pd_busy.url + "/ops/pools", timeout=30).json()["pools"]
    for role in ("prefill", "decode"):
        (worker,) = pools[role]["workers"]
        startup = worker["startup"]
        assert startup["kv_tokens"] == (worker["num_blocks"] - 1) * 16  # block 0 is null
        assert startup["weights_bytes"] > 0 and startup["kv_bytes"] > 0
        assert list(startup["seconds"]) == ["engine", "transfer set-up"]  # CPU: no warm-up
        (line,) = _log_lines(pd_busy, f"pdserve: {worker['worker_id']} ready in ")
        assert line == format_startup(worker["worker_id"], startup)
        assert line.endswith("; no CUDA graphs (eager)")
    stats = _log_lines(pd_busy, "decode pool (1 worker): ", 1, timeout_s=5)
    assert any(float(x.split("Avg generation throughput: ")[1].split(" ")[0]) > 0 for x in stats), (
        stats
    )
    assert any("Steps: 100% eager" in x for x in stats), stats  # CPU: no CUDA graphs
    assert _log_lines(pd_busy, "prefill pool (1 worker): Avg prompt throughput: ")

    body = {
        "model": "SmolLM2-135M-Instruct", "prompt": "Count: " + LONG, "max_tokens": 500,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    with httpx.stream(
        "POST", pd_busy.url + "/v1/completions", json=body, timeout=60,
        headers={"authorization": f"Bearer {KEY}"},
    ) as resp:  # fmt: skip
        first = next(line for line in resp.iter_lines() if line.startswith("data:"))
    gone = json.loads(first[5:])["id"]
    assert _log_lines(pd_busy, f"request {gone}: cancelled (the client went away) after ")


# What the router saw of a request's path: shown when a path assertion fails (a pull that
# fell back to recompute still answers right), one series a line (a list's repr is cut).
PATH_SERIES = (
    "pdserve:worker_stats_failures",
    "pdserve:kv_transfer",
    "pdserve:kv_recompute",
    "pdserve:pd_",
    "pdserve:kv_tier",
    "pdserve:num_requests",
)


def test_priority_requests_need_a_server_scheduling_by_priority(pd_busy, pd):
    """Guards `--scheduling-policy priority` end to end: a request's `priority` reaches
    the router's queue and both PD workers' schedulers (each refuses it under fcfs, so a
    remote prefill that lost it would fail), the answer is the usual one and the request
    log shows it; the default server refuses it with a 400 naming the flag."""
    before = pd_busy.metrics()
    ask = "For the priority check: which river runs through Paris? Answer in one sentence."
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=12, temperature=0,
              messages=[{"role": "user", "content": ask}])  # fmt: skip
    r = pd_busy.client().chat.completions.create(extra_body={"priority": -4}, **kw)
    name, after = "pdserve:pd_decisions_total", pd_busy.metrics()
    for reason, want in (("remote_prefill", 1), ("recompute_after_prefill_failure", 0)):
        assert _metric(after, name, reason=reason) - _metric(before, name, reason=reason) == want
    assert r.choices[0].message.content == (
        pd.client().chat.completions.create(**kw).choices[0].message.content
    )
    assert _log_lines(pd_busy, "priority=-4")
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
        pd.client().chat.completions.create(extra_body={"priority": 1}, **kw)


def test_pd_over_the_nccl_transport_path(pd_busy, pd):
    """Guards `--kv-transport nccl`: the workers form a process group, tickets advertise
    nccl, KV moves by P2P (counted under that transport, never tcp, whatever the server
    ran before), and the answer is the same."""
    r = pd_busy.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20, temperature=0
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    text = pd_busy.metrics()
    path = "\n".join(line for line in text.splitlines() if line.startswith(PATH_SERIES))
    why = ("could not", "release", "recompute", "transfer group", "lease")  # a fallback's log
    path += "\n" + "\n".join(ln for ln in pd_busy.log.read_text().splitlines() if any(
        w in ln for w in why))  # fmt: skip
    assert _metric(text, "pdserve:kv_transfer_pulls_total", transport="nccl") >= 1, path
    assert _metric(text, "pdserve:kv_transfer_pulls_total", transport="tcp") == 0
    # The same counter on the tcp server moves under tcp. Its own request, with a prompt
    # no other test sends (no prefix hit on the decode side): the assertion must not
    # depend on which tests ran before on the session's `pd` server.
    before = _metric(pd.metrics(), "pdserve:kv_transfer_pulls_total", transport="tcp")
    done = pd.client().completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
        prompt="For the transport check, the capitals read: France, Paris; Germany, Berlin; "
        "Spain, Madrid; Portugal, Lisbon; Italy,",
    )  # fmt: skip
    # 27 prompt tokens: the last block is partial, so only a pull can bring it even when
    # the tier already holds the full one (over tcp the tier's blocks come first).
    assert done.usage.prompt_tokens % 16 != 0, done.usage
    after = pd.metrics()
    tcp_path = [line for line in after.splitlines() if line.startswith(PATH_SERIES)]
    assert _metric(after, "pdserve:kv_transfer_pulls_total", transport="tcp") > before, (
        done.choices[0],
        "\n".join(tcp_path),
    )


def test_pd_with_layer_wise_early_tickets(pd_layer_wise, pd):
    """Guards `--kv-layer-wise` through the real services: the prefill service answers the
    router with the early ticket from inside its step (before the forward), the decode
    side streams the layers and takes the first token (and its logprobs) either relayed
    by the router as soon as the prefill sampled it or from the stream's end, exactly once.
    Answers, logprobs included, equal the default PD server's, every pull is counted under
    tcp and none fell back to recompute. (The server's decode worker drafts too: conftest.py.)"""
    r = pd_layer_wise.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20, temperature=0
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=LONG, max_tokens=6, temperature=0)
    got = pd_layer_wise.client().completions.create(**kwargs, logprobs=2)
    want = pd.client().completions.create(**kwargs, logprobs=2)
    assert got.choices[0].text == want.choices[0].text
    g, w = got.choices[0].logprobs, want.choices[0].logprobs
    assert g.tokens == w.tokens
    assert all(abs(a - b) < 1e-4 for a, b in zip(g.token_logprobs, w.token_logprobs)), (g, w)
    text = pd_layer_wise.metrics()
    path = "\n".join(line for line in text.splitlines() if line.startswith(PATH_SERIES))
    assert _metric(text, "pdserve:kv_transfer_pulls_total", transport="tcp") >= 2, path
    assert _metric(text, "pdserve:kv_recompute_fallbacks_total") == 0, path
    # Early tickets went out (the default server sends none): the path really ran.
    assert _metric(text, "pdserve:kv_early_tickets_total") >= 2, text
    # Each early ticket's first token reached the decode worker once, by either path.
    firsts = _metric(text, "pdserve:kv_early_first_tokens_total")
    assert firsts == _metric(text, "pdserve:kv_early_tickets_total"), text
    assert _metric(pd.metrics(), "pdserve:kv_early_tickets_total") == 0
    # Structured output over an early ticket: the decode worker learns the first token
    # after it queued the request, and its grammar must start after that token.
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"]}}}  # fmt: skip
    answers = [
        server.client().chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=20, temperature=0,
            response_format=fmt,
        ).choices[0].message.content
        for server in (pd_layer_wise, pd)
    ]  # fmt: skip
    assert answers[0] == answers[1] and "capital" in json.loads(answers[0]), answers
