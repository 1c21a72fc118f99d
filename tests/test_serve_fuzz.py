"""Seeded random requests with extreme field values against the README's PD server: each
answer is a 200 with choices (a stream's every event too) or an OpenAI-shaped 4xx, never
a 5xx, and the server keeps answering. Found by fuzzing like this, and fixed: a top_k of
3e9 killed the decode worker's loop, integers past 64 bits (which msgpack cannot carry to
a worker) were 500s, and so were chat_template_kwargs naming what the renderer binds
(`messages`, `raise_exception`; test_chat_template.py checks those directly)."""

from __future__ import annotations

import json
import random

import httpx
from serve_server import KEY

INT_FIELDS = (
    "n", "logprobs", "top_logprobs", "prompt_logprobs", "top_k", "seed", "min_tokens",
    "priority", "truncate_prompt_tokens", "max_tokens", "max_completion_tokens",
)  # fmt: skip
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty",
)  # fmt: skip
# Raw JSON, so that the values Python's json module reads but json.dumps would not write
# (NaN, Infinity, 1e400) reach the server too.
INTS = (
    "0", "1", "-1", "3", "21", "129", "2147483648", "9223372036854775807",
    "9223372036854775808", "-9223372036854775809", "18446744073709551616",
    "1000000000000000000000000000000", "1.5", "true", "null", '"5"',
)  # fmt: skip
FLOATS = (
    "0", "-0.0", "0.5", "2", "-2", "1e-300", "1e300", "1e400", "-1e400", "NaN", "Infinity",
    "-Infinity", "true", "null", '"1"',
)  # fmt: skip
PROMPTS = ('"Hello there"', '["a", "b"]', "[[1, 2, 3], [4]]", "[1, 2, 3]")
MESSAGES = (
    '[{"role": "user", "content": "Hi"}]',
    '[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]',
)
REQUESTS = 60


def _body(rng: random.Random, chat: bool) -> str:
    parts = [f'"messages": {rng.choice(MESSAGES)}' if chat else f'"prompt": {rng.choice(PROMPTS)}']
    if rng.random() < 0.3:
        parts.append('"stream": true')
    for f in rng.sample(INT_FIELDS, rng.randrange(4)):
        value = rng.choice(INTS)
        # Valid lengths and counts kept small, so that the run stays short (a null length
        # runs to the end of the context).
        if f in ("max_tokens", "max_completion_tokens", "n") and value.isdigit():
            value = str(min(int(value), 3)) if int(value) <= 2**63 else value
        elif f in ("max_tokens", "max_completion_tokens") and value == "null":
            value = "2"
        parts.append(f'"{f}": {value}')
    for f in rng.sample(FLOAT_FIELDS, rng.randrange(3)):
        parts.append(f'"{f}": {rng.choice(FLOATS)}')
    if rng.random() < 0.3:
        parts.append(f'"stop_token_ids": [{rng.choice(INTS)}]')
    if rng.random() < 0.3:
        token = rng.choice(("5", "49152", "99999999999999999999999"))
        parts.append(f'"logit_bias": {{"{token}": {rng.choice(FLOATS)}}}')
    if chat and rng.random() < 0.5:  # names the renderer binds itself, and free ones
        name = rng.choice(("messages", "raise_exception", "range", "bos_token", "shout"))
        parts.append(f'"chat_template_kwargs": {{"{name}": {rng.choice(INTS)}}}')
    if not any(p.startswith(('"max_tokens"', '"max_completion_tokens"')) for p in parts):
        parts.append('"max_tokens": 3')
    rng.shuffle(parts)
    return "{" + ", ".join(parts) + "}"


def _answer_is_well_formed(r: httpx.Response, streamed: bool) -> bool:
    if r.status_code >= 500:
        return False
    if r.status_code >= 400:
        return "message" in r.json().get("error", {})
    if not streamed:
        return bool(r.json()["choices"])
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])


def test_random_extreme_requests_get_answers_or_4xx(pd):
    rng = random.Random(20261204)
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=pd.url, headers=headers, timeout=120) as c:
        for _ in range(REQUESTS):
            chat = rng.random() < 0.4
            raw = _body(rng, chat)
            r = c.post("/v1/chat/completions" if chat else "/v1/completions", content=raw)
            assert _answer_is_well_formed(r, '"stream": true' in raw), (raw, r.text[:500])
        r = c.post("/v1/completions", json={"prompt": "The capital of France is",
                                            "max_tokens": 4, "temperature": 0})  # fmt: skip
    assert r.json()["choices"][0]["text"].startswith(" Paris.")
