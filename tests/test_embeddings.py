"""Embeddings (`LLM.embed`, runner/pooling.py): a prompt's final hidden states after the
last norm, pooled as the checkpoint says (last token, mean, CLS; normalised or not),
equal to transformers' `last_hidden_state` pooled the same way — for prompts prefilled in
chunks (mean sums across steps), beside generating requests in one batch, through the
prefix cache (last-token pooling may hit it; mean and CLS read every position, so not)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE

from pdserve import LLM, PoolingParams, SamplingParams

LENS = (5, 23, 70, 41)


def _prompts(seed: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 990) for _ in range(n)] for n in LENS]


def _reference(model_dir: str, prompts, method: str, normalize: bool) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            h = model(torch.tensor([ids], device=DEVICE)).last_hidden_state[0].float()
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
            out.append((F.normalize(v, dim=0) if normalize else v).cpu())
    return out


def _sentence_transformers(model_dir: str, folder: Path, mode: str, normalize: bool) -> str:
    """A copy of the model with Sentence-Transformers' pooling files."""
    shutil.copytree(model_dir, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = {k: k == mode for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                    "pooling_mode_max_tokens", "pooling_mode_lasttoken")}  # fmt: skip
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **modes})
    )
    return str(folder)


def _llm(model_dir: str) -> LLM:
    return LLM(model=model_dir, device=DEVICE, dtype="float32", block_size=16,
               max_num_batched_tokens=64)  # fmt: skip


def _check(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        # float32 on both sides: the layers' reduction orders differ, ~1e-6 of |h| ~ 1
        torch.testing.assert_close(torch.tensor(g.outputs.embedding), w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("mode", "method", "normalize"),
    [(None, "last", True), ("pooling_mode_mean_tokens", "mean", True),
     ("pooling_mode_cls_token", "cls", False), ("pooling_mode_lasttoken", "last", False)],
)  # fmt: skip
def test_pooled_prompts_match_transformers(tiny_qwen3_dir, tmp_path, mode, method, normalize):
    model_dir = tiny_qwen3_dir if mode is None else _sentence_transformers(
        tiny_qwen3_dir, tmp_path / "st", mode, normalize
    )  # fmt: skip
    prompts = _prompts()
    llm = _llm(model_dir)
    want = _reference(tiny_qwen3_dir, prompts, method, normalize)
    got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    _check(got, want)
    # Again: last-token pooling hits the cached prompt, mean and CLS recompute it.
    again = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    _check(again, want)
    cached = [o.num_cached_tokens for o in again]
    assert (max(cached) > 0) if method == "last" else (cached == [0] * len(prompts))


def test_normalize_per_request(tiny_llama_dir):
    prompts = _prompts(seed=8)[:2]
    llm = _llm(tiny_llama_dir)
    raw = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False),
                    use_tqdm=False)  # fmt: skip
    _check(raw, _reference(tiny_llama_dir, prompts, "last", False))
    assert abs(torch.tensor(raw[0].outputs.embedding).norm().item() - 1.0) > 1e-3
    # `dimensions` needs a Matryoshka model (tests/test_classify.py has one)
    with pytest.raises(ValueError, match="not a Matryoshka model"):
        llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(dimensions=8), use_tqdm=False)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="dimensions must be an integer"):
            PoolingParams(dimensions=bad)


def test_embeddings_beside_generation(tiny_llama_dir):
    """One engine, one batch: a generating request's tokens are those it gets alone, and
    the embedding requests beside it pool as alone."""
    prompts = _prompts(seed=9)
    llm = _llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    engine = llm.engine
    engine.add_request("gen", prompts[1], params)
    for i in (0, 2, 3):
        engine.add_pooling_request(f"emb-{i}", prompts[i], PoolingParams(normalize=True))
    tokens, vectors = [], {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id == "gen":
                tokens += d.new_token_ids
            elif d.embedding is not None:
                vectors[d.request_id] = d.embedding
                assert d.new_token_ids == [] and d.finish_reason == "stop"
    assert tokens == alone.outputs[0].token_ids
    want = _reference(tiny_llama_dir, [prompts[i] for i in (0, 2, 3)], "last", True)
    for i, w in zip((0, 2, 3), want, strict=True):
        torch.testing.assert_close(torch.tensor(vectors[f"emb-{i}"]), w, atol=2e-5, rtol=1e-5)


def test_base_model_checkpoint_serves_embeddings_only(tmp_path):
    """A checkpoint saved from `Qwen3Model` (Qwen3-Embedding's layout: no `model.` prefix,
    no LM head) pools as transformers does and refuses to generate, by name."""
    from transformers import AutoModel, Qwen3Config

    cfg = Qwen3Config(vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(3)
    AutoModel.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    prompts = _prompts(seed=10)
    llm = _llm(str(tmp_path))
    got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    _check(got, _reference(str(tmp_path), prompts, "last", True))
    with pytest.raises(ValueError, match="no LM head"):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2))


def test_score_is_the_cosine_of_the_embeddings(tiny_llama_dir):
    """vLLM's `LLM.score` for embedding models: one text against many, or pairs."""
    llm = _llm(tiny_llama_dir)
    tok = [{"prompt_token_ids": p} for p in _prompts(seed=12)]
    vecs = torch.tensor([o.outputs.embedding for o in llm.embed(tok, use_tqdm=False)])
    got = llm.score(tok[0], tok[1:], use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in got]), vecs[1:] @ vecs[0])
    pairs = llm.score(tok[:2], tok[2:], use_tqdm=False)
    want = torch.stack([vecs[0] @ vecs[2], vecs[1] @ vecs[3]])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairs]), want)
    with pytest.raises(ValueError, match="as many as text_2"):
        llm.score(tok[:2], tok[:3], use_tqdm=False)


def test_an_aborted_embedding_leaves_nothing_behind(tiny_llama_dir):
    """A request aborted after its step ran keeps no vector in the engine."""
    llm = _llm(tiny_llama_dir)
    engine = llm.engine
    engine.add_pooling_request("gone", _prompts(seed=13)[0])
    engine.add_pooling_request("kept", _prompts(seed=13)[1])
    so = engine.scheduler.schedule()
    handle = engine.runner.execute(so)
    engine.abort("gone")
    deltas = engine._process(so, handle.get())
    assert [d.request_id for d in deltas if d.embedding is not None] == ["kept"]
    assert engine._embeddings == {}
