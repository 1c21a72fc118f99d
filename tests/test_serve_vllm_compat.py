"""A `vllm serve`-style command line on a real `pdserve serve` (local Ray, the bundled
SmolLM2, colocated), driven with the official `openai` client: the model given as a
positional argument, two served names, a generation config whose defaults (greedy, a
48-token cap) requests that leave the fields out take, chat without max_tokens, text
content parts, prefix caching and chunked prefill turned off, async scheduling on, the KV cache sized
in bytes, a logprobs bound, no OpenAPI document, vLLM's response flags and TLS (a test CA's
certificate, client certificates optional: every call here checks the server against the
CA, as SSL_CERT_FILE makes httpx and the openai client do)."""

from __future__ import annotations

import json
import re
import ssl
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import certifi
import httpx
import openai
import pytest
from cli_in_process import cli_main
from serve_server import Server

STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake."}]
MAX_MODEL_LEN = 384
CAP = 48  # the generation config's max_new_tokens
KV_SIZE = "128M"  # 128 MiB of KV cache: --kv-cache-memory-bytes takes vLLM's size suffixes
TLS = Path(__file__).parent / "data" / "tls"  # test certificates (tests/test_tls.py)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_dir):
    gen = tmp_path_factory.mktemp("generation-config")
    (gen / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": CAP, "eos_token_id": 2})
    )
    # The model's own template, plus a variable only chat_template_kwargs set.
    from pdserve.runner.tokenizer import load_tokenizer

    template = gen / "chat.jinja"
    template.write_text(
        load_tokenizer(smollm_dir).chat_template + "{% if shout %}SHOUT SHOUT{% endif %}"
    )
    with pytest.MonkeyPatch.context() as env:  # this module's clients trust the test CA
        env.setenv("SSL_CERT_FILE", str(TLS / "ca.pem"))
        srv = _start(tmp_path_factory, smollm_dir, gen, template)
        yield srv
        srv.stop()


def _start(tmp_path_factory, smollm_dir, gen, template) -> Server:
    return Server(
        tmp_path_factory.mktemp("vllm-compat"), smollm_dir, "--served-model-name", "smol",
        "SmolLM2", "org/smol-2", "--chat-template", str(template), "--mode", "colocated", "--max-model-len",
        str(MAX_MODEL_LEN),
        "--generation-config", str(gen), "--seed", "3", "--no-enable-prefix-caching",
        "--enforce-eager", "-tp", "1", "--kv-cache-dtype", "auto", "--kv-cache-memory-bytes",
        KV_SIZE, "--no-enable-chunked-prefill", "--async-scheduling", "--max-logprobs", "3",
        "--disable-fastapi-docs", "--disable-log-requests", "--tokenizer-mode", "auto",
        "--max-log-len", "100", "--response-role", "bot", "--return-tokens-as-token-ids",
        "--enable-force-include-usage", "--enable-prompt-tokens-details",
        "--ssl-certfile", str(TLS / "server.pem"), "--ssl-keyfile", str(TLS / "server.key"),
        "--ssl-ca-certs", str(TLS / "ca.pem"), "--ssl-cert-reqs", "1",
        "--h11-max-incomplete-event-size", "65536", "--h11-max-header-count", "40",
        "--enable-request-id-headers", "--api-server-count", "1", "--stream-interval", "1",
        "--enable-server-load-tracking",
        tls_ca=str(TLS / "ca.pem"),
    )  # fmt: skip


def test_server_load_counts_requests_in_flight(server, colocated):
    """--enable-server-load-tracking: GET /load is 0 when idle, 1 while a stream is open
    (its first chunk read), 0 once it ended; a server without the flag answers 0."""
    load = lambda srv: httpx.get(srv.url + "/load", timeout=10).json()  # noqa: E731
    assert load(server) == {"server_load": 0}
    stream = _client(server).completions.create(
        model="smol", prompt="Once upon a time", max_tokens=16, stream=True
    )
    next(iter(stream))
    assert load(server) == {"server_load": 1}
    for _ in stream:
        pass
    deadline = time.monotonic() + 10  # the client can read [DONE] before the count drops
    while load(server) != {"server_load": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load(server) == {"server_load": 0}
    assert load(colocated) == {"server_load": 0}


def test_http_parser_bounds(server):
    """--h11-max-incomplete-event-size 65536: headers of 60 KB are read (a server with
    uvicorn's default bound answers them 400: measured), of 200 KB refused;
    --h11-max-header-count 40: 40 header fields pass, 41 are a 431 that names the flag."""
    assert httpx.get(server.url + "/health", headers={"x-big": "a" * 60_000}).is_success
    big = httpx.get(server.url + "/health", headers={"x-big": "a" * 200_000})
    assert big.status_code in (400, 431), big
    with httpx.Client() as client:
        base = len(client.build_request("GET", server.url + "/v1/models").headers)
        extra = {f"x-{i}": "1" for i in range(40 - base)}
        assert client.get(server.url + "/v1/models", headers=extra).is_success
        over = client.get(server.url + "/v1/models", headers={**extra, "x-41": "1"})
    assert over.status_code == 431
    assert "takes at most 40 (--h11-max-header-count)" in over.json()["error"]["message"]


def test_tls_with_optional_client_certificates(server):
    """--ssl-certfile / --ssl-keyfile: the API is HTTPS only, under the test CA's
    certificate for 127.0.0.1, and the log says https; --ssl-ca-certs with --ssl-cert-reqs
    1: a client certificate that CA signed is taken, one it did not sign ends the
    handshake, and a client without one is served."""
    assert server.url.startswith("https://")
    assert f"at {server.url}/v1" in server.log.read_text()
    plain = "http://" + server.url.removeprefix("https://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=10)
    public_cas = ssl.create_default_context(cafile=certifi.where())  # not the test CA
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health", timeout=10, verify=public_cas)

    def with_cert(name: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(TLS / "ca.pem"))
        ctx.load_cert_chain(TLS / f"{name}.pem", TLS / f"{name}.key")
        return ctx

    assert httpx.get(server.url + "/health", timeout=10, verify=with_cert("client")).is_success
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=10, verify=with_cert("rogue"))
    assert httpx.get(server.url + "/health", timeout=10).is_success  # no client certificate


def test_run_batch_against_the_tls_server(server, tmp_path):
    """`pdserve run-batch --base-url https://...` reaches a TLS server whose CA the client
    names with SSL_CERT_FILE (set for this module), as bench and contract do (httpx)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "Paris is", "max_tokens": 2}}) + "\n")  # fmt: skip
    code, err = cli_main("run-batch", "-i", str(src), "-o", str(dst), "--base-url", server.url)
    assert code == 0, err
    (line,) = [json.loads(x) for x in dst.read_text().splitlines()]
    assert line["custom_id"] == "a" and line["response"]["status_code"] == 200, line


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_served_names(server):
    ids = [m.id for m in _client(server).models.list().data]
    assert ids == ["smol", "SmolLM2", "org/smol-2"]
    r = _client(server).completions.create(model="SmolLM2", prompt="Paris is", max_tokens=2)
    assert r.model == "smol"  # responses carry the first name
    with pytest.raises(openai.NotFoundError, match="serves 'smol' or 'SmolLM2' or 'org/smol-2'"):
        _client(server).completions.create(model="SmolLM2-135M-Instruct", prompt="x")
    # OpenAI's "retrieve model", a name with a "/" included; a name not served is a 404
    for name in ids:
        card = _client(server).models.retrieve(name)
        assert (card.id, card.owned_by, card.model_extra["max_model_len"]) == (
            name, "pdserve", MAX_MODEL_LEN)  # fmt: skip
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(server).models.retrieve("SmolLM2-135M-Instruct")
    assert "default sampling parameters (generation config)" in server.log.read_text()


def test_left_out_fields_take_the_generation_config(server):
    """No temperature: greedy, from the config (two unseeded requests at OpenAI's
    temperature 1 would differ). No max_tokens in chat: up to the config's cap, not 16."""
    c = _client(server)
    asks = [{}, {}, dict(temperature=0, max_tokens=CAP), dict(max_tokens=200)]
    # A client's own temperature still wins over the server's default.
    asks += [dict(temperature=1.5, max_tokens=24)] * 3
    with ThreadPoolExecutor(len(asks)) as pool:  # at once: one batch on the server
        answers = list(
            pool.map(lambda kw: c.chat.completions.create(model="smol", messages=STORY, **kw), asks)
        )
    implicit, explicit, big, sampled = answers[:2], answers[2], answers[3], answers[4:]
    texts = {r.choices[0].message.content for r in implicit}
    assert texts == {explicit.choices[0].message.content}
    assert implicit[0].usage.completion_tokens == CAP > 16
    assert implicit[0].choices[0].finish_reason == "length"
    # The cap holds for an explicit max_tokens too, as vLLM's does.
    assert big.usage.completion_tokens == CAP
    assert len({r.choices[0].message.content for r in sampled}) > 1


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(server):
    long_story = [{"role": "user", "content": "Tell me more. " * 80 + STORY[0]["content"]}]
    r = _client(server).chat.completions.create(model="smol", messages=long_story)
    room = MAX_MODEL_LEN - r.usage.prompt_tokens
    assert 0 < room < CAP, r.usage
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (room, "length")


def test_text_parts_are_the_same_prompt(server):
    c = _client(server)
    parts = [
        {"type": "text", "text": "What is the capital"},
        {"type": "text", "text": "of France?"},
    ]
    a = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": parts}])
    b = c.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital\nof France?"}]
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        timeout=30,
    )
    assert bad.status_code == 400 and "text only" in bad.json()["error"]["message"]


def test_vllm_text_fields(server):
    """`include_stop_str_in_output` keeps the stop string; with `skip_special_tokens` off
    it keeps the end-of-turn token's text as well."""
    c = _client(server)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    plain = c.chat.completions.create(model="smol", messages=q).choices[0].message.content
    assert plain == "The capital of France is Paris."
    cut = c.chat.completions.create(model="smol", messages=q, stop=["France"])
    assert cut.choices[0].message.content == "The capital of "
    kept = c.chat.completions.create(
        model="smol", messages=q, stop=["France"], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == "The capital of France"
    raw = c.chat.completions.create(
        model="smol", messages=q,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert raw.choices[0].message.content == plain + "<|im_end|>"


def test_max_logprobs_and_no_openapi_document(server, colocated):
    """--max-logprobs 3: a request for 3 gets 3 a token, one for 4 a 400 naming the field;
    --disable-fastapi-docs: /openapi.json is a 404 (a server without it serves it)."""
    c = _client(server)
    kw = dict(model="smol", prompt="The capital of France is", max_tokens=2)
    top = c.completions.create(**kw, logprobs=3).choices[0].logprobs.top_logprobs
    assert [len(t) for t in top] == [3, 3]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(**kw, logprobs=4)
    assert e.value.body["param"] == "logprobs" and "--max-logprobs" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smol", messages=STORY, max_tokens=1, logprobs=True,
                                  top_logprobs=4)  # fmt: skip
    assert e.value.body["param"] == "top_logprobs"
    assert httpx.get(server.url + "/openapi.json", timeout=30).status_code == 404
    doc = httpx.get(colocated.url + "/openapi.json", timeout=30)
    assert doc.status_code == 200 and "/v1/chat/completions" in doc.json()["paths"]


def test_response_flags(server, colocated):
    """--response-role bot: chat replies' role; --enable-force-include-usage: a stream
    without stream_options ends with usage; --enable-prompt-tokens-details: usage has
    cached_tokens, 0 included (prefix caching is off here); --return-tokens-as-token-ids:
    logprobs name tokens by id unless the request says otherwise. The shared colocated
    server, started without them, answers as before (usage without details for a prompt
    nothing was cached for)."""
    q = [{"role": "user", "content": "What is the capital of France?"}]
    for srv, role in [(server, "bot"), (colocated, "assistant")]:
        c = _client(srv)
        model = "smol" if srv is server else "SmolLM2-135M-Instruct"
        r = c.chat.completions.create(model=model, messages=q, max_tokens=4)
        assert r.choices[0].message.role == role
        chunks = list(c.chat.completions.create(model=model, messages=q, max_tokens=4,
                                                stream=True))  # fmt: skip
        assert chunks[0].choices[0].delta.role == role
        last = chunks[-1]
        if srv is server:
            assert not last.choices and last.usage.completion_tokens == 4, last
            assert r.usage.prompt_tokens_details.model_dump(exclude_none=True) == {
                "cached_tokens": 0
            }
        else:
            assert last.choices and all(ch.usage is None for ch in chunks)
            # a prompt no earlier request shares a block with: nothing cached, no details
            fresh = c.completions.create(model=model, prompt=f"{uuid.uuid4().hex} is",
                                         max_tokens=1).usage  # fmt: skip
            assert fresh.prompt_tokens_details is None, fresh
    c = _client(server)
    kw = dict(model="smol", prompt="The capital of France is", max_tokens=2, logprobs=1)
    lp = c.completions.create(**kw).choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens), lp.tokens
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp.top_logprobs for k in top)
    text = c.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in text.choices[0].logprobs.tokens)


def test_continuous_usage_stats(server):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    (the role chunk 0 tokens), ending at the final usage chunk's counts; without it only
    the final chunk has usage."""
    c = _client(server)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        c.chat.completions.create(model="smol", messages=q, stream=True, stream_options=opts)
    )
    assert all(ch.usage is not None for ch in chunks)
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts[0] == 0 and counts == sorted(counts)
    final = chunks[-1].usage
    assert final.completion_tokens == counts[-2] > 0 and not chunks[-1].choices
    assert {ch.usage.prompt_tokens for ch in chunks} == {final.prompt_tokens}
    plain = list(
        c.chat.completions.create(
            model="smol", messages=q, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [ch.usage is not None for ch in plain] == [False] * (len(plain) - 1) + [True]
    assert plain[-1].usage == final
    # Not streamed, stream_options is refused (OpenAI's API and vLLM refuse it too).
    for path, body in (("chat/completions", {"messages": q}), ("completions", {"prompt": "x"})):
        r = httpx.post(
            f"{server.url}/v1/{path}",
            timeout=30,
            json={
                "model": "smol",
                "max_tokens": 2,
                "stream_options": {"include_usage": True},
                **body,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_tokenize_and_detokenize(server):
    """vLLM's tokenizer routes count what a request is charged, and map ids back."""
    c = _client(server)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(server.url + "/tokenize", json={"model": "smol", "messages": q}, timeout=30)
    r = c.chat.completions.create(model="smol", messages=q, max_tokens=1)
    assert chat.status_code == 200 and chat.json()["count"] == r.usage.prompt_tokens
    assert chat.json()["max_model_len"] == MAX_MODEL_LEN and chat.json()["token_strs"] is None
    one = httpx.post(
        server.url + "/tokenize", json={"prompt": "Paris is", "return_token_strs": True}
    ).json()
    assert one["token_strs"] == ["Paris", "Ġis"] and one["count"] == 2
    back = httpx.post(server.url + "/detokenize", json={"tokens": one["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "Paris is"}
    # An empty string counts 0 tokens (SmolLM2's tokenizer adds no BOS); a completion of
    # it is still refused, having nothing to continue.
    empty = httpx.post(server.url + "/tokenize", json={"prompt": ""}, timeout=30)
    assert (empty.status_code, empty.json()["count"], empty.json()["tokens"]) == (200, 0, [])
    for path, body, status in (
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": "1 2"}, 400),
        ("/tokenize", {"prompt": "x", "model": "gpt-17"}, 404),
        ("/tokenize", {"prompt": 5}, 400),
        ("/tokenize", {"prompt": []}, 400),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400),
    ):
        bad = httpx.post(server.url + path, json=body, timeout=30)
        assert bad.status_code == status and "error" in bad.json(), (path, bad.text)


def test_chat_template_flag_and_fields(server):
    """--chat-template's variables through chat_template_kwargs, and continue_final_message
    (the model finishes the assistant's open sentence)."""
    q = [{"role": "user", "content": "What is the capital of France?"}]

    def count(**extra) -> int:
        r = httpx.post(server.url + "/tokenize", json={"messages": q, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    assert count(chat_template_kwargs={"shout": True}) == count() + 4  # "SHOUT SHOUT"
    opened = [*q, {"role": "assistant", "content": "The capital of France is"}]
    r = _client(server).chat.completions.create(
        model="smol", messages=opened, max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert r.choices[0].message.content.startswith(" Paris"), r.choices[0].message.content
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": q, "chat_template_kwargs": {"tokenize": True}},
        timeout=30,
    )
    assert bad.status_code == 400 and "may not set" in bad.json()["error"]["message"]


def _cached(r) -> int:
    details = r.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def test_prefix_caching_is_off(server, colocated):
    """The same prompt twice: the second reuses cached blocks on a default server, and
    not on this one."""
    prompt = "The history of the city of Paris, told briefly: " * 6
    on = colocated.client()
    first = on.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2)
    again = on.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2)
    assert _cached(first) == 0 and _cached(again) >= 16, (first.usage, again.usage)
    off = _client(server)
    for _ in range(2):
        r = off.completions.create(model="smol", prompt=prompt, max_tokens=2)
        assert _cached(r) == 0, r.usage


def test_the_kv_cache_has_the_size_given(server, smollm_dir):
    """--kv-cache-memory-bytes 128M: as many whole blocks as 128 MiB holds, in the model's
    geometry (float32 on the CPU), in /ops/pools and the worker's startup line."""
    cfg = json.loads((Path(smollm_dir) / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4
    pools = httpx.get(server.url + "/ops/pools", timeout=30).json()["pools"]
    (worker,) = pools["decode"]["workers"]
    assert worker["num_blocks"] == (128 << 20) // per_block
    assert worker["startup"]["kv_bytes"] == worker["num_blocks"] * per_block
    assert f"KV cache {(worker['num_blocks'] - 1) * 16:,} tokens" in server.log.read_text()


def test_the_workers_report_the_engine_settings_the_flags_gave(server):
    """--no-enable-chunked-prefill, --async-scheduling (off by default on the CPU) and
    --no-enable-prefix-caching reach the worker's engine, and /ops/pools says so."""
    pools = httpx.get(server.url + "/ops/pools", timeout=30).json()["pools"]
    (worker,) = pools["decode"]["workers"]
    assert worker["startup"]["engine"] == {
        "runner": "mrv2", "device": "cpu", "dtype": "float32", "block_size": 16,
        "max_num_seqs": 64, "max_num_batched_tokens": 2048, "enable_chunked_prefill": False,
        "enable_prefix_caching": False, "kv_cache_dtype": "auto", "async_scheduling": True,
        "scheduling_policy": "fcfs",
    }  # fmt: skip
