"""vLLM's `return_token_ids` (what RL rollouts read instead of re-tokenizing): on the
README's PD server and the colocated one, a choice carries its output's token ids and the
prompt's come with them (chat: once at the top; completions: per choice, the ids of that
choice's prompt). A stream sends each chunk's ids, the prompt's on the first chunk, and
keeps the ids of text a tool or reasoning parser holds back, so a stream's ids are the
whole reply's."""

from __future__ import annotations

import json

import httpx

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST", server.url + path, json={"model": MODEL, "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _tokenize(server, body: dict) -> list[int]:
    return _post(server, "/tokenize", body)["tokens"]


def _detokenize(server, ids: list[int]) -> str:
    return _post(server, "/detokenize", {"tokens": ids})["prompt"]


def test_completions_return_their_token_ids(pd):
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    body = {"prompt": prompts, "max_tokens": 8, "n": 2, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    whole = _post(pd, "/v1/completions", body)
    for c in whole["choices"]:
        prompt = prompts[c["index"] // 2]
        assert c["prompt_token_ids"] == _tokenize(pd, {"prompt": prompt})
        assert _detokenize(pd, c["token_ids"]) == c["text"]
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == whole["usage"]["completion_tokens"]
    streamed: dict[int, list[int]] = {}
    prompt_ids: dict[int, list] = {}
    for chunk in _stream(pd, "/v1/completions", body):
        for c in chunk["choices"]:
            if c["index"] not in streamed:  # its first chunk
                prompt_ids[c["index"]] = c["prompt_token_ids"]
            else:
                assert "prompt_token_ids" not in c
            streamed.setdefault(c["index"], []).extend(c["token_ids"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert prompt_ids == {c["index"]: c["prompt_token_ids"] for c in whole["choices"]}
    plain = _post(pd, "/v1/completions", {**body, "return_token_ids": False})
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])


def test_chat_returns_its_token_ids(pd):
    body = {"messages": QUESTION, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    whole = _post(pd, "/v1/chat/completions", body)
    assert whole["prompt_token_ids"] == _tokenize(pd, {"messages": QUESTION})
    (c,) = whole["choices"]
    assert len(c["token_ids"]) == whole["usage"]["completion_tokens"]
    assert _detokenize(pd, c["token_ids"]).startswith(c["message"]["content"])
    chunks = _stream(pd, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    streamed = [t for ch in chunks for c in ch["choices"] for t in c.get("token_ids", [])]
    assert streamed == c["token_ids"]


def test_held_back_text_keeps_its_token_ids(colocated):
    """A `required` tool reply is held back until its calls' names are whole (16 of its
    26 chunks here): those chunks still carry their ids."""
    tools = [{"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    }}]  # fmt: skip
    body = {"messages": QUESTION, "max_tokens": 40, "temperature": 0, "tools": tools,
            "tool_choice": "required", "return_token_ids": True}  # fmt: skip
    whole = _post(colocated, "/v1/chat/completions", body)
    (c,) = whole["choices"]
    assert c["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert len(c["token_ids"]) == whole["usage"]["completion_tokens"]
    chunks = _stream(colocated, "/v1/chat/completions", body)
    streamed = [t for ch in chunks for x in ch["choices"] for t in x.get("token_ids", [])]
    assert streamed == c["token_ids"]
