"""Completions as lm-eval's `local-completions` sends them, on the README's PD server: a
batch of prompts (strings or token-id arrays) in one request, and `echo` with logprobs,
which scores a prompt's tokens (its loglikelihood requests). The prompt's logprobs are
checked against transformers on the same weights; PD routes such requests to prefill on
the decode worker, where the prompt's forward runs."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def hf_model(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


def _post(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _decisions(server, reason: str) -> float:
    for line in server.metrics().splitlines():
        if line.startswith("pdserve:pd_decisions") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_loglikelihood_requests_match_transformers(pd, hf_model, smollm_dir):
    """lm-eval's payload: token-id prompts, max_tokens 1, logprobs 1, echo."""
    from pdserve.runner.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm_dir)
    ids = [tok(p).input_ids for p in PROMPTS]
    before = _decisions(pd, "prompt_logprobs")
    out = _post(
        pd, {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1,
             "seed": 1234, "echo": True},
    )  # fmt: skip
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert out["usage"]["completion_tokens"] == 2
    for choice, prompt_ids, text in zip(out["choices"], ids, PROMPTS):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt_ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert choice["text"].startswith(text) and len(choice["text"]) > len(text)
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0].float(), -1)
        for pos in range(1, len(prompt_ids)):
            want = ref[pos - 1, prompt_ids[pos]].item()
            assert lp["token_logprobs"][pos] == pytest.approx(want, abs=1e-4), pos
            top = lp["top_logprobs"][pos]
            best = ref[pos - 1].max().item()
            assert max(top.values()) == pytest.approx(best, abs=1e-4)
        # The generated token's logprob is the greedy one: the top of the last position.
        assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)
    assert _decisions(pd, "prompt_logprobs") == before + 2


def test_echo_with_max_tokens_0_is_the_prompt_alone(pd, hf_model, smollm_dir):
    """OpenAI's legacy API and vLLM score a prompt with `echo` and `max_tokens` 0: each
    choice is the prompt and its logprobs, nothing generated, finish_reason length and no
    completion tokens; streamed, the same text in one chunk. The logprobs are checked
    against transformers; without echo, or in chat, 0 stays refused."""
    from pdserve.runner.tokenizer import load_tokenizer

    ids = [load_tokenizer(smollm_dir)(p).input_ids for p in PROMPTS]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "logprobs": 2, "echo": True}
    out = _post(pd, dict(body, n=2))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, ids))}  # fmt: skip
    for c in out["choices"]:
        prompt_ids, text = ids[c["index"] // 2], PROMPTS[c["index"] // 2]
        assert (c["text"], c["finish_reason"]) == (text, "length")
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt_ids)
        assert lp["token_logprobs"][0] is None
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt_ids])).logits[0].float(), -1)
        for pos in range(1, len(prompt_ids)):
            want = ref[pos - 1, prompt_ids[pos]].item()
            assert lp["token_logprobs"][pos] == pytest.approx(want, abs=1e-4), pos
            assert len(lp["top_logprobs"][pos]) >= 2
    chunks = []
    with httpx.stream(
        "POST", pd.url + "/v1/completions", timeout=120,
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 0, "echo": True,
              "stream": True, "stream_options": {"include_usage": True}},
    ) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == PROMPTS[0]
    assert [c["finish_reason"] for ch in chunks for c in ch["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    for extra, path in (({}, "/v1/completions"), ({"echo": False}, "/v1/completions"),
                        ({"echo": True}, "/v1/chat/completions")):  # fmt: skip
        req = {"model": MODEL, "max_tokens": 0, **extra}
        req.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                   else {"prompt": "hi"})  # fmt: skip
        r = httpx.post(pd.url + path, json=req, timeout=30)
        assert r.status_code == 400 and "at least 1" in r.text, (extra, path, r.text)


def test_a_batch_of_prompts_is_choices_in_prompt_order(pd):
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2}
    out = _post(pd, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    singles = [
        _post(pd, {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0}) for p in PROMPTS
    ]
    texts = [c["text"] for c in out["choices"]]
    assert texts == [singles[0]["choices"][0]["text"]] * 2 + [singles[1]["choices"][0]["text"]] * 2
    assert out["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert out["usage"]["completion_tokens"] == 24
    # Streamed, the same choices (by index), the echo in each choice's first chunk.
    echoed = _post(pd, dict(body, n=1, echo=True))
    chunks: dict[int, list[str]] = {}
    with httpx.stream(
        "POST", pd.url + "/v1/completions", json=dict(body, n=1, echo=True, stream=True),
        timeout=120,
    ) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    chunks.setdefault(c["index"], []).append(c["text"])
    assert {i: "".join(t) for i, t in chunks.items()} == {
        c["index"]: c["text"] for c in echoed["choices"]
    }
    assert [c["text"] for c in echoed["choices"]] == [
        p + s["choices"][0]["text"] for p, s in zip(PROMPTS, singles)
    ]
    assert all(chunks[i][0].startswith(p) for i, p in enumerate(PROMPTS))


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "string or an array of token ids"),
        (["ok", 5], "string or an array of token ids"),
        ([[1, 2], []], "string or an array of token ids"),
        (["ok", ""], "empty"),
    ],
)
def test_bad_batches_are_refused(pd, prompt, message):
    r = httpx.post(pd.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def _metric(server, name: str, **labels: str) -> float:
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_token_and_finish_metrics_count_every_choice(pd):
    """vLLM's request counters: prompt tokens, and each finished choice by its reason."""
    names = {
        "prompt": ("pdserve:prompt_tokens_total", {}),
        "length": (
            "pdserve:request_success_total",
            {"kind": "completion", "finished_reason": "length"},
        ),
        "histogram": ("pdserve:request_generation_tokens_count", {}),
    }
    before = {k: _metric(pd, n, **lab) for k, (n, lab) in names.items()}
    out = _post(
        pd, {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "n": 2, "ignore_eos": True}
    )
    after = {k: _metric(pd, n, **lab) for k, (n, lab) in names.items()}
    assert after["prompt"] - before["prompt"] == out["usage"]["prompt_tokens"]
    assert after["length"] - before["length"] == 4  # 2 prompts x n=2, each cut by max_tokens
    assert after["histogram"] - before["histogram"] == 1  # one HTTP request


def test_vllm_prompt_logprobs_field(pd, hf_model, smollm_dir):
    """vLLM's `prompt_logprobs` request field: per choice in completions, at the top of a
    chat response; checked against transformers; refused with streaming, as vLLM does."""
    from pdserve.runner.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm_dir)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    # Asked once without: its blocks are then cached on the decode worker (and written to
    # the KV tier). The prompt_logprobs request must still compute every position; it once
    # took the cached blocks through the tier's load path and left those rows None.
    plain = {"model": MODEL, "messages": q, "max_tokens": 2}
    assert httpx.post(pd.url + "/v1/chat/completions", json=plain, timeout=120).status_code == 200
    r = httpx.post(
        pd.url + "/v1/chat/completions", json={**plain, "prompt_logprobs": 1}, timeout=120
    )
    assert r.status_code == 200, r.text
    out = r.json()
    entries = out["prompt_logprobs"]
    text = tok.apply_chat_template(q, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(entries) == len(ids) == out["usage"]["prompt_tokens"] and entries[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        own = entries[pos][str(ids[pos])]
        assert own["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4), pos
        assert own["decoded_token"] == tok.decode([ids[pos]])
        assert min(e["rank"] for e in entries[pos].values()) == 1
    comp = _post(pd, {"model": MODEL, "prompt": PROMPTS, "max_tokens": 1, "prompt_logprobs": 0})
    for c, p in zip(comp["choices"], PROMPTS):
        assert len(c["prompt_logprobs"]) == len(tok(p).input_ids) and "logprobs" in c
    bad = httpx.post(
        pd.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True},
        timeout=30,
    )
    assert bad.status_code == 400 and "stream" in bad.json()["error"]["message"]
