"""LoRA adapters (runner/lora/): a PEFT adapter served beside the base weights gives the
tokens of transformers running the merged model `W + s * B A`, per request in a mixed
batch (adapters and the base model side by side, prompts prefilled in chunks), through
the prefix cache (KV under an adapter is never another's) and across slot reuse."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ATTN, DEVICE, MLP, _save_tiny, hf_greedy, make_lora_adapter
from safetensors.torch import load_file, save_file
from test_ernie4_5_moe import tiny_ernie_moe_dir  # noqa: F401 - fixtures used by name
from test_gemma import (  # noqa: F401 - fixtures used by name
    tiny_gemma1_dir,
    tiny_gemma2_dir,
    tiny_gemma3_dir,
)
from test_gpt_oss import tiny_gpt_oss_dir  # noqa: F401 - fixtures used by name
from test_llama4 import tiny_llama4_dir  # noqa: F401 - fixtures used by name

from pdserve import LoRARequest
from pdserve.runner.block_hash import salt_root

PROMPT_LENS = (5, 23, 70, 41)
NEW = 12


def _merged(base_dir: str, deltas: dict[str, torch.Tensor], folder: Path) -> str:
    shutil.copytree(base_dir, folder)
    (file,) = sorted(folder.glob("*.safetensors"))
    tensors = load_file(file)
    for name, d in deltas.items():
        tensors[name] = tensors[name] + d
    save_file(tensors, file, metadata={"format": "pt"})
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Two adapters (every projection, rank 8; q and v only, rank 4 with rsLoRA) and the
    merged models transformers runs for each."""
    root = tmp_path_factory.mktemp("lora")
    full = make_lora_adapter(tiny_llama_dir, root / "full", ATTN + MLP, 8, 16.0, seed=1)
    qv = make_lora_adapter(
        tiny_llama_dir, root / "qv", ("q_proj", "v_proj"), 4, 8.0, 2, rslora=True
    )
    return {
        "full": (LoRARequest("full", 1, str(root / "full")), _merged(tiny_llama_dir, full, root / "m-full")),
        "qv": (LoRARequest("qv", 2, str(root / "qv")), _merged(tiny_llama_dir, qv, root / "m-qv")),
    }  # fmt: skip


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 990) for _ in range(n)] for n in PROMPT_LENS]


def _llm(model_dir: str, **kw):
    from pdserve import LLM

    base = dict(device=DEVICE, dtype="float32", block_size=16, max_num_batched_tokens=64,
                enable_lora=True, max_loras=2, max_lora_rank=8)  # fmt: skip
    return LLM(model=model_dir, **(base | kw))


def _generate(llm, prompts, loras):
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_matches_merged_models(tiny_llama_dir, adapters):
    prompts = _prompts()
    (full, full_dir), (qv, qv_dir) = adapters["full"], adapters["qv"]
    choice = [full, None, qv, full]
    llm = _llm(tiny_llama_dir)
    kernels = "triton" if DEVICE.startswith("cuda") else "torch"  # kernels/lora.py
    assert llm.engine.execution_path["lora"] == f"2x r8 {kernels}"
    got = _generate(llm, prompts, choice)
    refs = {None: tiny_llama_dir, "full": full_dir, "qv": qv_dir}
    for p, lora, out in zip(prompts, choice, got, strict=True):
        name = None if lora is None else lora.lora_name
        assert out == hf_greedy(refs[name], [p], NEW)[0], f"{name}, prompt of {len(p)}"
    # The adapters matter: their tokens are not the base model's.
    base = hf_greedy(tiny_llama_dir, [prompts[0], prompts[2]], NEW)
    assert got[0] != base[0] and got[2] != base[1]


def test_prefix_cache_is_per_adapter(tiny_llama_dir, adapters):
    (full, full_dir) = adapters["full"]
    prompt = _prompts(seed=9)[2]  # 70 tokens: four full blocks to cache
    llm = _llm(tiny_llama_dir)
    base = _generate(llm, [prompt], None)
    assert base == hf_greedy(tiny_llama_dir, [prompt], NEW)
    expected = hf_greedy(full_dir, [prompt], NEW)
    for _ in range(2):  # the second run hits the adapter's own cached blocks
        assert _generate(llm, [prompt], full) == expected
    assert _generate(llm, [prompt], None) == base
    assert llm.engine.kv.prefix_cache_hits > 0


def test_one_slot_serves_adapters_in_turn(tiny_llama_dir, adapters):
    """max_loras=1: an adapter no live request runs with gives its slot to the next."""
    (full, full_dir), (qv, qv_dir) = adapters["full"], adapters["qv"]
    from pdserve import SamplingParams

    llm = _llm(tiny_llama_dir, max_loras=1)
    prompts = _prompts(seed=5)[:2]
    # vLLM's lora_requests_info: a queued request's adapter shows as waiting
    llm.engine.add_request("probe", [5, 6, 7], SamplingParams(max_tokens=1), lora_request=full)
    assert llm.engine.lora_requests() == {"max_lora": 1, "running": [], "waiting": ["full"]}
    llm.engine.abort("probe")
    assert llm.engine.lora_requests()["waiting"] == []
    for lora, ref in ((full, full_dir), (qv, qv_dir), (full, full_dir)):
        assert _generate(llm, prompts, lora) == hf_greedy(ref, prompts, NEW)
    with pytest.raises(ValueError, match="max_loras=1"):
        _generate(llm, prompts, [full, qv])


def test_bad_adapters_are_refused_by_name(tiny_llama_dir, adapters, tmp_path):
    (full, _) = adapters["full"]
    llm = _llm(tiny_llama_dir, max_lora_rank=4)
    with pytest.raises(ValueError, match="max_lora_rank"):
        _generate(llm, _prompts()[:1], full)  # rank 8 > 4
    lm_head = tmp_path / "lm_head"
    shutil.copytree(full.lora_path, lm_head)
    tensors = load_file(lm_head / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 120)
    save_file(tensors, lm_head / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="lm_head"):
        _generate(_llm(tiny_llama_dir), _prompts()[:1], LoRARequest("h", 3, str(lm_head)))
    with pytest.raises(ValueError, match="1 lora requests for 2 prompts"):
        _generate(llm, _prompts()[:2], [full])
    with pytest.raises(ValueError, match="adapter_config.json"):
        _generate(llm, _prompts()[:1], LoRARequest("x", 4, str(tmp_path / "missing")))
    from pdserve import LLM

    plain = LLM(model=tiny_llama_dir, device=DEVICE, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        _generate(plain, _prompts()[:1], full)
    # Nothing was queued by the refused calls: the engines still serve.
    assert _generate(plain, _prompts()[:1], None) == hf_greedy(tiny_llama_dir, _prompts()[:1], NEW)


def test_adapter_roots_are_their_own():
    roots = {salt_root(None), salt_root(None, "a"), salt_root(None, "b"), salt_root("s"),
             salt_root("s", "a"), salt_root("a"), salt_root(None, "s")}  # fmt: skip
    assert len(roots) == 7
    assert salt_root(None) is None and salt_root(None, "a") == salt_root(None, "a")


@pytest.fixture(scope="module")
def tiny_olmo2_dir(tmp_path_factory) -> str:
    from test_post_norm_models import _configs

    return _save_tiny(tmp_path_factory, "tiny-olmo2-lora", _configs()["olmo2"])


def _tiny_glm(tmp_path_factory, arch: str) -> str:
    from test_glm4 import COMMON
    from transformers import Glm4Config, GlmConfig

    config = GlmConfig if arch == "GlmForCausalLM" else Glm4Config
    return _save_tiny(tmp_path_factory, f"tiny-{arch}-lora", config(architectures=[arch], **COMMON))


@pytest.fixture(scope="module")
def tiny_glm_dir(tmp_path_factory) -> str:
    return _tiny_glm(tmp_path_factory, "GlmForCausalLM")


@pytest.fixture(scope="module")
def tiny_glm4_0414_dir(tmp_path_factory) -> str:
    return _tiny_glm(tmp_path_factory, "Glm4ForCausalLM")


@pytest.fixture(scope="module")
def tiny_ernie_dir(tmp_path_factory) -> str:
    from test_llama_variants import _config

    return _save_tiny(tmp_path_factory, "tiny-ernie-lora", _config("ernie4_5"))


@pytest.fixture(scope="module")
def tiny_arcee_dir(tmp_path_factory) -> str:
    from test_arcee import _config

    return _save_tiny(tmp_path_factory, "tiny-arcee-lora", _config())


@pytest.fixture(scope="module")
def tiny_command_r_plus_dir(tmp_path_factory) -> str:
    from test_cohere import _cohere, _save_with_random_qk_norms

    return _save_with_random_qk_norms(tmp_path_factory, _cohere(use_qk_norm=True))


@pytest.mark.parametrize(
    "family",
    ["tiny_granite_dir", "tiny_qwen3_dir", "tiny_gemma1_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
     "tiny_olmo2_dir",
     "tiny_glm_dir", "tiny_glm4_0414_dir", "tiny_ernie_dir", "tiny_command_r_plus_dir",
     "tiny_arcee_dir"],
)  # fmt: skip
def test_other_families_match_merged_models(family, request, tmp_path):
    """Granite folds its residual multiplier into the o and down weights at load, so their
    deltas are scaled alike; Qwen3's and Gemma 3's q/k norms, and OLMo 2's over all heads,
    read the adapted projections; Gemma's GeGLU reads the adapted gate and up, and its
    sandwich norms and OLMo's post-norms the adapted o and down. GLM-4 (9B and 0414), ERNIE
    4.5 and Command R+ reorder their q/k rows at load for the interleaved RoPE: the q/k deltas'
    rows move with them (GLM over half of each head); GLM's gate and up come fused, and
    Command R+'s per-head q/k norms and parallel block read the adapted projections;
    Arcee's gateless relu^2 MLP takes its up and down deltas."""
    base_dir = request.getfixturevalue(family)
    mlp = ("gate_up_proj", "down_proj") if "glm" in family else MLP
    mlp = ("up_proj", "down_proj") if "arcee" in family else mlp
    deltas = make_lora_adapter(base_dir, tmp_path / "a", ATTN + mlp, 4, 8.0, seed=4)
    merged = _merged(base_dir, deltas, tmp_path / "merged")
    prompts = _prompts(seed=11)[:2]
    got = _generate(_llm(base_dir), prompts, LoRARequest("a", 1, str(tmp_path / "a")))
    assert got == hf_greedy(merged, prompts, NEW)


@pytest.mark.parametrize(
    "family", ["tiny_ernie_moe_dir", "tiny_llama4_dir", "tiny_glm4_moe_dir", "tiny_gpt_oss_dir"]
)
def test_moe_families_adapt_their_attention(family, request, tmp_path):
    """ERNIE 4.5 MoE and Llama 4 (interleaved RoPE, reordered at load; Llama 4's NoPE
    layers and chunked attention), GLM-4.5 (half-head RoPE, q/k norms) and gpt-oss
    (attention sinks, biases, sliding layers): an adapter on q/k/v/o of every layer equals
    the merged model. Their experts take none (refused by name, like Mixtral's)."""
    base_dir = request.getfixturevalue(family)
    deltas = make_lora_adapter(base_dir, tmp_path / "a", ATTN, 4, 8.0, seed=5)
    merged = _merged(base_dir, deltas, tmp_path / "merged")
    prompts = _prompts(seed=12)[:2]
    got = _generate(_llm(base_dir), prompts, LoRARequest("a", 1, str(tmp_path / "a")))
    assert got == hf_greedy(merged, prompts, NEW)


def test_other_attention_layouts_are_refused_by_name(tiny_deepseek_v2_dir):
    """MLA (DeepSeek) projects q/k/v otherwise than the sites LoRA adds deltas to."""
    from pdserve import LLM

    with pytest.raises(ValueError, match=r"DeepseekForCausalLM \(deepseek_v2\) is not one"):
        LLM(model=tiny_deepseek_v2_dir, device=DEVICE, dtype="float32", enable_lora=True)
