"""Sequence classifiers (`LLM.classify`, cross-encoder `LLM.score`; runner/classify.py),
Matryoshka embeddings (`PoolingParams(dimensions=)`) and `hf_overrides`:
- a `Qwen3ForSequenceClassification` checkpoint's probabilities equal transformers' (softmax
  of its logits; sigmoid for one label; raw logits on request), for prompts prefilled in
  chunks and in one batch;
- the bundled SmolLM2, made a reranker by `hf_overrides` (Qwen3-Reranker's conversion:
  the head is the LM head's "yes" row minus its "no" row), scores pairs as transformers'
  causal LM does: sigmoid(logit(yes) - logit(no)) at the pair prompt's last position;
- a Matryoshka model's vector is its hidden state's first `dimensions` features,
  normalised after the cut;
- each task refuses the other's requests and parameters by name."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE

from pdserve import LLM, PoolingParams, SamplingParams

LENS = (5, 23, 70, 41)


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENS]


def _classifier_dir(tmp_path_factory, num_labels: int, problem_type: str | None = None) -> str:
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=997, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=36,
        max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=num_labels,
        problem_type=problem_type, architectures=["Qwen3ForSequenceClassification"],
        id2label={i: f"class-{i}" for i in range(num_labels)},
    )  # fmt: skip
    torch.manual_seed(77)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp(f"qwen3-cls-{num_labels}-{problem_type}")
    model.save_pretrained(path)
    return str(path)


def _logits(model_dir: str, prompts) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(DEVICE).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p], device=DEVICE)).logits[0].float().cpu() for p in prompts]


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model=model_dir, device=DEVICE, dtype="float32", block_size=16,
               max_num_batched_tokens=64, **kwargs)  # fmt: skip


def _close(got: list[float], want: torch.Tensor) -> None:
    # float32 on both sides: the layers' reduction orders differ (~1e-6 of values ~1)
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-5)


def test_classifier_matches_transformers(tmp_path_factory):
    model_dir = _classifier_dir(tmp_path_factory, 3)
    prompts = _prompts(997)
    logits = _logits(model_dir, prompts)
    llm = _llm(model_dir)
    out = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for o, want in zip(out, logits, strict=True):
        _close(o.outputs.probs, want.softmax(0))
        assert o.outputs.num_classes == 3
    raw = llm.classify({"prompt_token_ids": prompts[2]}, PoolingParams(activation=False),
                       use_tqdm=False)  # fmt: skip
    _close(raw[0].outputs.probs, logits[2])
    assert llm.engine.pooling.classifier.labels == ("class-0", "class-1", "class-2")
    # a classifier serves classify and score only
    with pytest.raises(ValueError, match="is a classifier"):
        llm.embed({"prompt_token_ids": prompts[0]}, use_tqdm=False)
    with pytest.raises(ValueError, match="no LM head: it serves classify"):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2),
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"classify requests take \['activation'\]"):
        llm.classify({"prompt_token_ids": prompts[0]}, PoolingParams(normalize=True),
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b", use_tqdm=False)


@pytest.mark.parametrize(("problem_type", "activation"),
                         [(None, torch.sigmoid), ("regression", lambda x: x)])  # fmt: skip
def test_one_label_activation_follows_the_problem_type(tmp_path_factory, problem_type, activation):
    model_dir = _classifier_dir(tmp_path_factory, 1, problem_type)
    prompts = _prompts(997, seed=5)[:2]
    out = _llm(model_dir).classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for o, want in zip(out, _logits(model_dir, prompts), strict=True):
        _close(o.outputs.probs, activation(want))


RERANKER = {
    "architectures": ["LlamaForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def test_smollm2_as_a_reranker_matches_its_lm_head(smollm_dir):
    """The converted head's sigmoid is the 2-way softmax of the LM's yes/no logits; the
    per-token conversion gives both tokens' logits, whose softmax is the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    query = "Does the document answer where Paris is? Answer yes or no."
    docs = [
        "Paris is the capital of France.",
        "Bananas are yellow.",
        "The Seine runs through Paris",
    ]
    lm = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    want = []
    with torch.inference_mode():
        for doc in docs:
            last = lm(torch.tensor([tok(query, text_pair=doc).input_ids])).logits[0, -1]
            want.append(last[[no, yes]])
    want = torch.stack(want)
    llm = LLM(model=smollm_dir, device="cpu", dtype="float32", hf_overrides=RERANKER)
    assert llm.engine.pooling.classifier.from_token_ids == (no, yes)
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    _close(scores, torch.sigmoid(want[:, 1] - want[:, 0]))
    pairs = llm.score([query] * 2, docs[:2], use_tqdm=False)  # pairs of equal lists
    _close([o.outputs.score for o in pairs], torch.sigmoid(want[:2, 1] - want[:2, 0]))
    per_token = {**RERANKER, "is_original_qwen3_reranker": False}
    llm = LLM(model=smollm_dir, device="cpu", dtype="float32", hf_overrides=per_token)
    out = llm.classify([{"prompt_token_ids": tok(query, text_pair=d).input_ids} for d in docs],
                       PoolingParams(activation=False), use_tqdm=False)  # fmt: skip
    _close([x for o in out for x in o.outputs.probs], want.flatten())


def test_bad_smollm2_conversions_are_refused(smollm_dir):
    for overrides, message in (
        ({**RERANKER, "classifier_from_token": ["no", "not-a-token-at-all"]}, "is not one token"),
        ({**RERANKER, "classifier_from_token": ["yes"]}, "needs two tokens"),
        ({**RERANKER, "method": "max"}, "method must be"),
        ('{"architectures": ', "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ):
        with pytest.raises(ValueError, match=message):
            LLM(model=smollm_dir, device="cpu", hf_overrides=overrides)


def test_matryoshka_dimensions_cut_then_normalise(tiny_qwen3_dir):
    from transformers import AutoModel

    prompts = _prompts(997, seed=6)[:3]
    model = AutoModel.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).to(DEVICE).eval()
    with torch.inference_mode():
        hidden = [model(torch.tensor([p], device=DEVICE)).last_hidden_state[0, -1].cpu()
                  for p in prompts]  # fmt: skip
    llm = _llm(tiny_qwen3_dir, hf_overrides={"is_matryoshka": True})
    ids = [{"prompt_token_ids": p} for p in prompts]
    cut = llm.embed(ids, PoolingParams(dimensions=16), use_tqdm=False)
    for o, h in zip(cut, hidden, strict=True):
        assert len(o.outputs.embedding) == 16
        _close(o.outputs.embedding, F.normalize(h[:16], dim=0))
    raw = llm.embed(ids[0], PoolingParams(dimensions=40, normalize=False), use_tqdm=False)
    _close(raw[0].outputs.embedding, hidden[0][:40])
    full = llm.embed(ids[0], use_tqdm=False)  # no dimensions: the whole vector
    _close(full[0].outputs.embedding, F.normalize(hidden[0], dim=0))
    with pytest.raises(ValueError, match="at most the model's 96"):
        llm.embed(ids[0], PoolingParams(dimensions=97), use_tqdm=False)
    with pytest.raises(ValueError, match=r"embed requests take \['normalize', 'dimensions'\]"):
        llm.embed(ids[0], PoolingParams(activation=False), use_tqdm=False)
    with pytest.raises(ValueError, match="not a classifier"):
        llm.classify(ids[0], use_tqdm=False)
    listed = _llm(tiny_qwen3_dir, hf_overrides={"matryoshka_dimensions": [16, 32]})
    assert len(listed.embed(ids[0], PoolingParams(dimensions=32), use_tqdm=False)[0]
               .outputs.embedding) == 32  # fmt: skip
    with pytest.raises(ValueError, match=r"takes \[16, 32\] \(got 20\)"):
        listed.embed(ids[0], PoolingParams(dimensions=20), use_tqdm=False)
