"""`pdserve serve --enable-lora --lora-modules NAME=PATH` (vLLM's flags), PD mode on the
bundled SmolLM2: a request whose `model` names the adapter runs with it on the prefill
worker and on the decode worker that pulls its KV, and answers as the offline engine
with the same adapter does (itself checked against transformers on merged weights in
test_lora.py); the base model's name still answers as the base model, cached prefixes
do not cross between them, and /v1/models lists the adapter under its base."""

from __future__ import annotations

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


def _offline(smollm_dir: str, adapter: str) -> dict[str | None, str]:
    llm = LLM(model=smollm_dir, device="cpu", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    out = {}
    for name in (None, "tuned"):
        lora = None if name is None else LoRARequest(name, 1, adapter)
        out[name] = llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora)[0]
    texts = {k: v.outputs[0].text for k, v in out.items()}
    lora = LoRARequest("tuned", 1, adapter)
    texts["embedding"] = llm.embed(PROMPT, use_tqdm=False, lora_request=lora)[0].outputs.embedding
    return texts


def _decisions(text: str, reason: str) -> float:
    key = f'pdserve:pd_decisions_total{{model_name="SmolLM2-135M-Instruct",reason="{reason}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(key))


def test_pd_server_serves_the_adapter(smollm_dir, adapter, tmp_path):
    expected = _offline(smollm_dir, adapter)
    assert expected["tuned"] != expected[None]  # the adapter changes the reply
    server = Server(
        tmp_path, "--device", "cpu", "--enable-lora", "--lora-modules", f"tuned={adapter}",
        "--max-lora-rank", "8",
    )  # fmt: skip
    try:
        client = server.client()
        models = {m.id: m for m in client.models.list().data}
        assert models["tuned"].model_extra["parent"] == "SmolLM2-135M-Instruct"
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
    finally:
        server.stop()


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
