"""OLMo 2, OLMo 3 and EXAONE 4 (runner/models/post_norm.py) on mrv2 equal transformers:
greedy tokens and their logprobs.

Each tiny model has its family's marks: norms on the branch outputs (randomised: at
init they are ones, which would hide a norm applied to the wrong tensor), OLMo's q/k
norms over all heads at once, EXAONE 4's per head; OLMo 3's and EXAONE 4's 5-key windows
on their sliding layers, OLMo 3's full layers rotating with YaRN while its sliding ones do
not, and EXAONE 4's full layers rotating nothing (global NoPE). Prompts run past the
windows, prefilled in 64-token chunks, and decode 20 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
)
from safetensors.torch import load_file, save_file

from pdserve.runner.models.rope import rope_free_layers

COMMON = dict(
    vocab_size=1009, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def _configs():
    from transformers import Exaone4Config, Olmo2Config, Olmo3Config

    return {
        "olmo2": Olmo2Config(num_hidden_layers=2, architectures=["Olmo2ForCausalLM"], **COMMON),
        "olmo3": Olmo3Config(
            num_hidden_layers=4,
            sliding_window=5,
            architectures=["Olmo3ForCausalLM"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                },
            },
            **COMMON,
        ),  # fmt: skip
        "exaone4": Exaone4Config(
            num_hidden_layers=4,
            sliding_window=5,
            sliding_window_pattern=2,
            architectures=["Exaone4ForCausalLM"],
            **COMMON,
        ),  # fmt: skip
    }


@pytest.fixture(scope="module", params=["olmo2", "olmo3", "exaone4"])
def model_dir(request, tmp_path_factory) -> str:
    path = _save_tiny(tmp_path_factory, f"tiny-{request.param}", _configs()[request.param])
    (file,) = sorted(Path(path).glob("*.safetensors"))
    tensors = load_file(file)
    g = torch.Generator().manual_seed(3)
    for name, t in tensors.items():
        if "norm" in name:
            tensors[name] = 1 + 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_exaone4_rotates_no_position_on_its_global_layers():
    cfg = _configs()["exaone4"]
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert rope_free_layers(cfg) == {1, 3}


def test_greedy_tokens_and_logprobs_match_transformers(model_dir):
    assert_greedy_matches_hf(model_dir, (1, 9, 33, 90), 20, seed=6)
    assert_logprobs_match_hf(model_dir, [(5 * i + 2) % 1000 + 3 for i in range(33)], 8)
