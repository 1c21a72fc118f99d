"""vLLM's `--tokenizer` (`LLM(tokenizer=...)`): the tokenizer read from another folder than
the model's. The tiny random model ships none (outputs are token ids only); given the
bundled SmolLM2's tokenizer folder it detokenizes with that one, and the text equals that
tokenizer's decoding of the ids."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from pdserve import LLM, SamplingParams
from pdserve.runner.model_source import resolve_tokenizer_dir


def test_a_tokenizer_folder_detokenizes_the_models_ids(tiny_llama_dir, smollm_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    prompt = {"prompt_token_ids": [5, 17, 101, 9]}
    without = LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32")
    assert without.engine.tokenizer is None
    llm = LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32", tokenizer=smollm_dir)
    assert llm.engine.config.model.tokenizer_path == smollm_dir
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == without.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out.text == llm.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_an_unknown_tokenizer_is_refused():
    with pytest.raises(ValueError, match="unknown tokenizer"):
        resolve_tokenizer_dir("./no/such/folder")
