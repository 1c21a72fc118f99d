"""Multimodal checkpoints served as text (runner/models/text_only.py): Mistral Small
3.1/3.2's Mistral3ForConditionalGeneration runs its language model as MistralForCausalLM
on mrv2. (Gemma 3's: tests/test_gemma.py, against transformers' multimodal model.)

transformers has no causal-LM class for the Mistral3 checkpoint, so the reference is the
checkpoint's language model saved as a plain MistralForCausalLM (its tensors renamed,
the vision tower and projector dropped): greedy tokens and logprobs must match it, and
loading must not need a single vision tensor.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DEVICE, assert_logprobs_match_hf, hf_greedy
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def mistral3_pair(tmp_path_factory) -> tuple[str, str]:
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=2, image_size=28, patch_size=14,
                                 head_dim=16)  # fmt: skip
    cfg = Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         image_token_index=1000,
                         architectures=["Mistral3ForConditionalGeneration"])  # fmt: skip
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("tiny-mistral3")
    AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    twin = path.parent / "tiny-mistral3-text"
    shutil.copytree(path, twin)
    (file,) = sorted(path.glob("*.safetensors"))
    tensors = load_file(file)
    assert any(n.startswith("vision_tower.") for n in tensors), "the checkpoint has a tower"
    text_only = {}
    for name, t in tensors.items():
        if name.startswith("language_model."):
            text_only[name.removeprefix("language_model.")] = t
    save_file(text_only, twin / file.name, metadata={"format": "pt"})
    # transformers ties the head by the outer config (True here: no lm_head is saved)
    assert cfg.tie_word_embeddings and not any("lm_head" in n for n in tensors)
    config = text.to_dict() | {"architectures": ["MistralForCausalLM"], "tie_word_embeddings": True}
    (twin / "config.json").write_text(json.dumps(config))
    return str(path), str(twin)


def test_language_model_matches_its_text_twin(mistral3_pair):
    mm_dir, text_dir = mistral3_pair
    llm = LLM(model=mm_dir, device=DEVICE, dtype="float32")
    model_config = llm.engine.config.model
    assert model_config.architecture == "MistralForCausalLM"
    assert model_config.text_only_of == "Mistral3ForConditionalGeneration"
    assert llm.runner_name == "mrv2"
    prompts = [[5, 17, 101, 9], [(7 * i) % 900 + 3 for i in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, exp in zip(outs, hf_greedy(text_dir, prompts, 12)):
        assert out.outputs[0].token_ids == exp
    assert_logprobs_match_hf(mm_dir, prompts[1], 6, ref_dir=text_dir)
