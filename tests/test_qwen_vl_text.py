"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints served as text (runner/models/
text_only.py): their language model runs as Qwen2ForCausalLM / Qwen3ForCausalLM (Qwen3-MoE's
layer for the MoE) on mrv2
and equals transformers' image-text model fed text only.

Why that holds: the multimodal RoPE rotates each frequency band by one of a token's
three positions (time, height, width; `mrope_section` splits the bands, Qwen3-VL
interleaving them), and a text token has the same position on all three, so every band
turns by it as in the text model's RoPE. The tiny models' sections are uneven ([2, 3, 3]
of 8 bands) so a wrong split would show if positions ever differed. The checkpoints hold
a vision tower (`visual.*` in Qwen2/2.5-VL's layout, `model.visual.*` in Qwen3-VL's), which
is never loaded.
"""

from __future__ import annotations

import glob
import shutil

import pytest
import torch
from conftest import DEVICE, assert_greedy_matches_hf, assert_logprobs_match_hf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve import LLM

TEXT = dict(
    vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)


def _qwen2_vl():
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    return Qwen2VLConfig(text_config=TEXT | {"rope_parameters": rope}, vision_config=vision,
                         architectures=["Qwen2VLForConditionalGeneration"])  # fmt: skip


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}
    return Qwen2_5_VLConfig(text_config=TEXT | {"rope_parameters": rope}, vision_config=VISION,
                            architectures=["Qwen2_5_VLForConditionalGeneration"])  # fmt: skip


def _qwen3_vl():
    from transformers import Qwen3VLConfig

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
            "rope_theta": 1e6}  # fmt: skip
    return Qwen3VLConfig(text_config=TEXT | {"rope_parameters": rope},
                         vision_config=VISION | {"deepstack_visual_indexes": [0]},
                         architectures=["Qwen3VLForConditionalGeneration"])  # fmt: skip


def _qwen3_vl_moe():
    from transformers import Qwen3VLMoeConfig

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
            "rope_theta": 1e6}  # fmt: skip
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
               decoder_sparse_step=1, mlp_only_layers=[0])  # fmt: skip
    return Qwen3VLMoeConfig(text_config=TEXT | moe | {"rope_parameters": rope},
                            vision_config=VISION | {"deepstack_visual_indexes": [0]},
                            architectures=["Qwen3VLMoeForConditionalGeneration"])  # fmt: skip


CONFIGS = {
    "qwen2_vl": (_qwen2_vl, "Qwen2ForCausalLM"),
    "qwen2_5_vl": (_qwen2_5_vl, "Qwen2ForCausalLM"),
    "qwen3_vl": (_qwen3_vl, "Qwen3ForCausalLM"),
    # a dense layer 0 and a sparse layer 1, its experts saved [E, in, out]
    "qwen3_vl_moe": (_qwen3_vl_moe, "Qwen3MoeForCausalLM"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def vl_dir(request, tmp_path_factory) -> tuple[str, str]:
    from transformers import AutoModelForImageTextToText

    make, text_arch = CONFIGS[request.param]
    torch.manual_seed(1234)
    model = AutoModelForImageTextToText.from_config(make(), dtype=torch.float32)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model.save_pretrained(path)
    return str(path), text_arch


def test_language_model_matches_transformers(vl_dir):
    path, text_arch = vl_dir
    (file,) = glob.glob(f"{path}/*.safetensors")
    with safe_open(file, "pt") as f:
        names = list(f.keys())  # noqa: SIM118 - safe_open is not a mapping
    assert any("visual." in name for name in names), "the checkpoint has a tower"
    llm = assert_greedy_matches_hf(path, (5, 40, 90), 12, seed=3)
    config = llm.engine.config.model
    assert config.architecture == text_arch and config.text_only_of is not None
    assert_logprobs_match_hf(path, [(7 * i) % 900 + 3 for i in range(40)], 6)


def test_the_text_config_keeps_the_bias_and_norms_of_its_family(vl_dir):
    """Qwen2/2.5-VL's language model has q/k/v biases (Qwen2's), Qwen3-VL's per-head q/k
    norms (Qwen3's): a family spec that missed either would load and run wrong."""
    path, text_arch = vl_dir
    llm = LLM(model=path, device=DEVICE, dtype="float32")
    attn = llm.engine.runner.model.layers[0].self_attn
    if text_arch == "Qwen2ForCausalLM":
        assert attn.qkv_proj.bias is not None and attn.q_norm is None
    else:
        assert attn.qkv_proj.bias is None and attn.q_norm is not None
    if text_arch == "Qwen2ForCausalLM":
        return


def test_experts_saved_as_released_load_the_same(tmp_path):
    """Qwen3-VL-MoE's released checkpoints stack the experts [E, in, out] (gate/up
    [E, H, 2I], down [E, I, H]); transformers 5 saves them [E, out, in], as ours. Either
    loads to the same experts: turned when the shape says so, as transformers does."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    saved = tmp_path / "saved"
    AutoModelForImageTextToText.from_config(_qwen3_vl_moe()).save_pretrained(saved)
    released = tmp_path / "released"
    shutil.copytree(saved, released)
    (file,) = released.glob("*.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    assert tensors["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (6, 64, 48)
    save_file(tensors, file, metadata={"format": "pt"})
    models = [LLM(model=str(p), device=DEVICE, dtype="float32").engine.runner.model
              for p in (saved, released)]  # fmt: skip
    for a, b in zip(*(m.layers[1].mlp.parameters() for m in models), strict=True):
        assert torch.equal(a, b)
