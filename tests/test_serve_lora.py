"""`pdserve serve --enable-lora --lora-modules NAME=PATH` (vLLM's flags), PD mode on the
bundled SmolLM2: a request whose `model` names the adapter runs with it on the prefill
worker and on the decode worker that pulls its KV, and answers as the offline engine
with the same adapter does (itself checked against transformers on merged weights in
test_lora.py); the base model's name still answers as the base model, cached prefixes
do not cross between them, and /v1/models lists the adapter under its base. With vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING, adapters load and unload at run time; one unloaded and
loaded again under its name from other weights answers with the new weights, not the
old one's cached KV."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from conftest import ATTN, make_lora_adapter
from serve_server import Server

from pdserve import LLM, LoRARequest, SamplingParams

PROMPT = "The history of the printing press begins in the fifteenth century, when a goldsmith"
NEW = 10


@pytest.fixture(scope="module")
def adapter(smollm_dir, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("adapters") / "tuned"
    make_lora_adapter(smollm_dir, folder, ATTN, 4, 8.0, seed=21)
    return str(folder)


@pytest.fixture(scope="module")
def other_adapter(smollm_dir, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("adapters") / "other"
    make_lora_adapter(smollm_dir, folder, ATTN, 4, 8.0, seed=22)
    return str(folder)


def _offline(smollm_dir: str, adapter: str, other: str) -> dict[str | None, str]:
    llm = LLM(model=smollm_dir, device="cpu", enable_lora=True, max_lora_rank=8, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = {}
    for name, path in ((None, None), ("tuned", adapter), ("other", other)):
        lora = None if name is None else LoRARequest(name, 1, path)
        out[name] = llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0]
    texts = {k: v.outputs[0].text for k, v in out.items()}
    lora = LoRARequest("tuned", 1, adapter)
    texts["embedding"] = llm.embed(PROMPT, use_tqdm=False, lora_request=lora)[0].outputs.embedding
    return texts


def _decisions(text: str, reason: str) -> float:
    key = f'pdserve:pd_decisions_total{{model_name="SmolLM2-135M-Instruct",reason="{reason}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(key))


def test_pd_server_serves_the_adapter(smollm_dir, adapter, other_adapter, tmp_path, monkeypatch):
    expected = _offline(smollm_dir, adapter, other_adapter)
    assert len({expected["tuned"], expected[None], expected["other"]}) == 3  # each its own
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # the server inherits it
    server = Server(
        tmp_path, "--device", "cpu", "--enable-lora", "--lora-modules", f"tuned={adapter}",
        "--max-lora-rank", "8",
    )  # fmt: skip
    try:
        client = server.client()
        models = {m.id: m for m in client.models.list().data}
        assert models["tuned"].model_extra["parent"] == "SmolLM2-135M-Instruct"
        assert client.models.retrieve("tuned").model_extra["root"] == str(adapter)
        # Adapter, base, adapter again: the second adapter request meets the base model's
        # cached prompt on the same workers and must not take it.
        for name in ("tuned", "SmolLM2-135M-Instruct", "tuned"):
            r = client.completions.create(
                model=name, prompt=PROMPT, max_tokens=NEW, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            key = "tuned" if name == "tuned" else None
            assert r.model == name
            assert r.choices[0].text == expected[key], name
        # The adapter's and the base model's prompts each prefilled remotely; the third
        # found the adapter's own prompt cached on the decode worker.
        text = server.metrics()
        assert _decisions(text, "remote_prefill") == 2
        assert _decisions(text, "prefix_hit_on_decode") == 1
        # vLLM's lora_requests_info, a series per worker (nothing running between requests)
        info = [ln for ln in text.splitlines() if ln.startswith("pdserve:lora_requests_info{")]
        assert len(info) == 2 and all('max_lora="1"' in ln for ln in info), info
        assert {'role="prefill"' in ln for ln in info} == {True, False}
        chat = client.chat.completions.create(
            model="tuned", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.model == "tuned"
        # An embedding under the adapter is the adapter's (offline, same adapter)
        emb = client.embeddings.create(model="tuned", input=PROMPT)
        assert emb.model == "tuned"
        got, want = emb.data[0].embedding, expected["embedding"]
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-5
        with pytest.raises(openai.NotFoundError, match="tuned"):
            client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
        _runtime_loading(server, client, expected, adapter, other_adapter)
    finally:
        server.stop()


def _runtime_loading(server, client, expected, adapter: str, other: str) -> None:
    import httpx

    def post(path: str, body: dict) -> httpx.Response:
        headers = {"Authorization": "Bearer test-key"}
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60)

    def text(model: str) -> str:
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert r.model == model
        return r.choices[0].text

    r = post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": other})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert "other" in {m.id for m in client.models.list().data}
    assert text("other") == expected["other"]
    for body, status, words in (
        ({"lora_name": "other", "lora_path": other}, 400, "already been loaded"),
        ({"lora_name": "SmolLM2-135M-Instruct", "lora_path": other}, 400, "already been loaded"),
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, 400, "no adapter_config.json"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ):
        r = post("/v1/load_lora_adapter", body)
        assert r.status_code == status and words in r.text, (body, r.text)
    # "tuned" unloaded, then loaded again from other weights: it answers with those, though
    # its earlier prompt's KV (the same prompt) is still cached under its first load
    assert post("/v1/unload_lora_adapter", {"lora_name": "tuned"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="tuned"):
        text("tuned")
    assert post("/v1/unload_lora_adapter", {"lora_name": "tuned"}).status_code == 404
    assert post("/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": other}).is_success
    assert text("tuned") == expected["other"]
    assert text("SmolLM2-135M-Instruct") == expected[None]
    models = {m.id: m for m in client.models.list().data}
    assert models["tuned"].model_extra["root"] == str(Path(other).resolve())


def test_runtime_lora_routes_need_vllms_switch():
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING (or without --enable-lora) the routes are
    not there; the switch reads as vLLM reads it."""
    import asyncio

    import httpx

    from pdserve.cluster.http_app import AppState, build_app
    from pdserve.cluster.lora_routes import runtime_updates_allowed
    from pdserve.cluster.metrics import Metrics
    from pdserve.cluster.route_policy import RouterConfig
    from pdserve.cluster.router import Router

    async def statuses(runtime_rank: int | None) -> list[int]:
        router = Router(RouterConfig(mode="colocated"), [], [])
        app = build_app(AppState(router, None, "m", 64, Metrics("m"),
                                 runtime_lora_rank=runtime_rank))  # fmt: skip
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.post(path, json={})).status_code
                    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")]  # fmt: skip

    assert asyncio.run(statuses(None)) == [404, 404]  # no routes
    assert asyncio.run(statuses(8)) == [400, 400]  # the routes: the body lacks lora_name
    for value, allowed in (("True", True), ("1", True), (" true ", True), ("0", False),
                           ("false", False), ("", False)):  # fmt: skip
        assert runtime_updates_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is allowed
    assert runtime_updates_allowed({}) is False


def test_runtime_keys_never_repeat():
    """An adapter loaded again under its name gets a key no earlier load had, so its
    block hashes never meet the earlier weights' cached KV."""
    from pdserve.cluster.lora_registry import LoraRegistry

    reg = LoraRegistry()
    assert reg.add("a", "/p1").key == "a"  # a name never keyed before keeps it
    reg.remove("a")
    assert reg.add("a", "/p2").key == "a@1"
    reg.remove("a")
    assert reg.add("a", "/p3").key == "a@2"
    assert reg.add("a@3", "/p4").key == "a@3"
    reg.remove("a")
    assert reg.add("a", "/p5").key == "a@4"  # a@3 is taken by the adapter named so
    assert reg.served_name("a@2") == "a" and reg.served_name("a@3") == "a@3"


def test_bad_lora_flags_stop_the_start(tmp_path):
    from pdserve.cluster.serve_args import ServeConfig

    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServeConfig(lora_modules=("a=/x",))
    with pytest.raises(ValueError, match="name=path"):
        ServeConfig(enable_lora=True, lora_modules=("nopath",))
    with pytest.raises(ValueError, match="given twice"):
        ServeConfig(enable_lora=True, lora_modules=("a=/x", '{"name": "a", "path": "/y"}'))
    assert ServeConfig(enable_lora=True, lora_modules=('{"name": "b", "path": "/y"}',)
                       ).lora_module_map == {"b": "/y"}  # fmt: skip
