"""Runner selection: auto falls back with a warning naming the feature; forced mrv2 raises."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import DEVICE

from pdserve import LLM, SamplingParams
from pdserve.runner.runner_select import mrv2_unsupported_features, select_runner


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, GPT2Config

    cfg = GPT2Config(
        vocab_size=257,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def test_auto_on_llama_family_picks_mrv2(tiny_llama_dir):
    assert LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32").runner_name == "mrv2"


def test_auto_with_unsupported_architecture_warns_and_falls_back(tiny_gpt2_dir, caplog):
    """Guards the honest-path promise: the operator is told why mrv2 is not used."""
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=tiny_gpt2_dir, device=DEVICE, dtype="float32")
    assert llm.runner_name == "reference"
    assert any(
        "GPT2LMHeadModel" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records
    )
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(temperature=0, max_tokens=4, min_tokens=4),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_forced_mrv2_on_unsupported_architecture_raises(tiny_gpt2_dir):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=tiny_gpt2_dir, device=DEVICE, dtype="float32", runner="mrv2")


def test_unsupported_rope_and_activation_are_named(tiny_llama_dir):
    """Each unsupported feature is listed by name, not a generic refusal."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    assert mrv2_unsupported_features(cfg) == []
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    cfg.hidden_act = "relu"
    problems = mrv2_unsupported_features(cfg)
    assert any("dynamic" in p for p in problems) and any("relu" in p for p in problems)
    with pytest.raises(ValueError, match="dynamic.*relu"):
        select_runner("mrv2", cfg)
    assert select_runner("auto", cfg) == "reference"


def test_env_var_applies_only_when_argument_is_auto(tiny_llama_dir, monkeypatch):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    monkeypatch.setenv("PDSERVE_RUNNER", "reference")
    assert select_runner("auto", cfg) == "reference"
    assert select_runner("mrv2", cfg) == "mrv2"
    monkeypatch.setenv("PDSERVE_RUNNER", "bogus")
    with pytest.raises(ValueError, match="runner must be one of"):
        select_runner("auto", cfg)
