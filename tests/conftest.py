"""Shared fixtures: the bundled SmolLM2 (converted once, cached), tiny random models saved
with save_pretrained, and transformers' greedy `generate` as the oracle."""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any


def _cuda_present() -> bool:
    # Decided before torch or triton is imported: Triton reads TRITON_INTERPRET when a
    # kernel is defined, so the interpreter must be chosen before any kernel module loads.
    return os.path.exists("/dev/nvidia0") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


if not _cuda_present():
    # No GPU (CI, dev boxes): Triton kernels run through the interpreter on CPU tensors.
    # Model runs on CPU never launch Triton (CPU tensors take the torch reference path).
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _num_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([g for g in visible.split(",") if g.strip()])
    return len(glob.glob("/dev/nvidia[0-9]*"))


# GPU-only test modules are not collected without a GPU (rather than collected and skipped);
# two-GPU ones not without two. Listed by name: test_gpu_binding.py runs on the CPU too.
collect_ignore = ([] if _num_gpus() >= 2 else ["test_gpu_peer_ipc.py"]) + (
    []
    if _cuda_present()
    else [
        "test_gpu_step_loop.py",
        "test_gpu_attention.py",
        "test_gpu_kernels.py",
        "test_gpu_cuda_ipc.py",
        "test_gpu_copy_stream.py",
        "test_gpu_norm_fold.py",
        "test_gpu_tier_write_behind.py",
        "test_gpu_compile_watch.py",
        "test_gpu_moe.py",
        "test_gpu_mla.py",
        "test_gpu_hybrid_graphs.py",
        "gpu_ipc_source_proc.py",
        "gpu_ipc_dead_source_proc.py",
        "gpu_ipc_layouts.py",
    ]
)

import pytest  # noqa: E402
import torch  # noqa: E402

# Importing pdserve first takes the checkout root off sys.path, so a transformers model that
# imports the `kernels` distribution (Seed-OSS's hub-kernel layers) does not find the root's
# kernels/ instead (pdserve/source_tree.py).
import pdserve  # noqa: E402, F401

# Device the engine tests run on: "cpu" in CI; "cuda" on the GPU machine runs the same
# parity and self-consistency tests through the Triton / async / CUDA-graph path.
DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")

# Under pytest-xdist (the README's `-n 2`) the cores are shared by the workers: each takes
# its share, as oversubscribed intra-op threads spin against each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1) // _WORKERS))


SHARED_SERVERS = pytest.StashKey["SharedServers"]()


def pytest_configure(config):
    from shared_servers import SharedServers

    config.stash[SHARED_SERVERS] = SharedServers(
        {"pd": _start_pd, "colocated": _start_colocated, "pd_layer_wise": _start_pd_layer_wise}
    )


@pytest.hookimpl(trylast=True)  # after -k / -m have chosen the run's tests
def pytest_collection_modifyitems(config, items):
    """Keeps `xdist_schedule.SHARED_SERVER_FILES` true (a file using one of the session's
    servers that is not listed would start its own copy under `-n 2`), runs those files in
    one stretch and notes each server's last user (tests/shared_servers.py)."""
    from shared_servers import contiguous
    from xdist_schedule import SHARED_SERVER_FILES

    servers = config.stash[SHARED_SERVERS]
    users = {item.path.name for item in items if servers.starts.keys() & set(item.fixturenames)}
    if users - SHARED_SERVER_FILES:
        raise pytest.UsageError(
            f"add {sorted(users - SHARED_SERVER_FILES)} to tests/xdist_schedule.py's "
            "SHARED_SERVER_FILES: they use one of the session's servers"
        )
    contiguous(items, lambda item: item.path.name in SHARED_SERVER_FILES)
    servers.plan(items)


def pytest_runtest_teardown(item, nextitem):
    item.config.stash[SHARED_SERVERS].after(item)


def pytest_sessionfinish(session):
    session.config.stash[SHARED_SERVERS].stop_all()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the GPU run goes without
def pytest_xdist_make_scheduler(config, log):
    from xdist_schedule import make_scheduler

    return make_scheduler(config, log)


# The session's servers: test_bench_contract and test_serve_e2e both use them, and a start
# costs CI ~20-60 s. Each runs from the first test that asks for it to the last
# (tests/shared_servers.py). No test changes their state beyond counters (which tests read
# as deltas or lower bounds); tests that kill workers or need other flags start their own.


@pytest.fixture
def pd(request, tmp_path_factory):
    """`pdserve serve` as the README runs it (PD mode, 1 prefill + 1 decode worker, a tier
    actor, the bundled SmolLM2) on a free port, shared by every test that asks for it."""
    return request.config.stash[SHARED_SERVERS].get("pd", tmp_path_factory)


def _start_pd(log_dir: Path):
    from serve_server import Server

    return Server(log_dir)


@pytest.fixture
def colocated(request, tmp_path_factory):
    """Colocated mode, and it answers tool_choice auto (hermes calls; `pd` refuses it) and
    splits chat replies' reasoning with the qwen3 parser. That parser leaves a reply that
    does not open with `<think>` as it is, so SmolLM2's replies, which never do, come back
    as without it (deepseek_r1 would read every such reply as reasoning). Its grammars hold
    whole replies (`enable_in_reasoning`), so a test's regex can spell a think block that
    SmolLM2 would never write (by default a grammar holds the answer after the block)."""
    return request.config.stash[SHARED_SERVERS].get("colocated", tmp_path_factory)


def _start_colocated(log_dir: Path):
    from serve_server import Server

    return Server(
        log_dir, "--mode", "colocated", "--max-model-len", "1024",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--structured-outputs-config", '{"enable_in_reasoning": true}',
    )  # fmt: skip


# test_serve_speculative's drafts: its prompt is a list the model keeps going
SERVE_DRAFTS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture
def pd_layer_wise(request, tmp_path_factory):
    """PD with `--kv-layer-wise` (early tickets, each layer streamed as it is written) and
    n-gram drafts on the decode worker, shared by test_serve_e2e's layer-wise test and
    test_serve_speculative; the two features meet on its decode worker, and each test's
    answers are checked against a server or engine without them."""
    return request.config.stash[SHARED_SERVERS].get("pd_layer_wise", tmp_path_factory)


def _start_pd_layer_wise(log_dir: Path):
    import json

    from serve_server import Server

    return Server(
        log_dir, "--kv-layer-wise", "--max-model-len", "1024",
        "--speculative-config", json.dumps(SERVE_DRAFTS),
    )  # fmt: skip


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    from pdserve.runner.model_source import resolve_model_dir

    return str(resolve_model_dir(None)[0])


def _save_tiny(tmp_factory, name: str, config, dtype: torch.dtype = torch.float32) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
    path = tmp_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Llama, untied head, 6 q / 3 kv heads of head_dim 20 (not a power of two), llama3 RoPE."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1003,
        hidden_size=120,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=20,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        bos_token_id=1,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    return _save_tiny(tmp_path_factory, "tiny-llama", cfg)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """Qwen3, tied embeddings, q/k RMSNorm, 4 q heads / 1 kv head of head_dim 36."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=997,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=36,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen3ForCausalLM"],
    )
    return _save_tiny(tmp_path_factory, "tiny-qwen3", cfg)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """Qwen2 (q/k/v bias), 2 kv heads, yarn RoPE, untied."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=1009,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 256,
        },
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen2ForCausalLM"],
    )
    return _save_tiny(tmp_path_factory, "tiny-qwen2", cfg)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> str:
    """Mistral without a sliding window: MHA (3 q / 3 kv heads), linear RoPE scaling."""
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=1001,
        hidden_size=72,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        max_position_embeddings=512,
        sliding_window=None,
        tie_word_embeddings=False,
        initializer_range=0.1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        bos_token_id=1,
        eos_token_id=2,
        architectures=["MistralForCausalLM"],
    )
    return _save_tiny(tmp_path_factory, "tiny-mistral", cfg)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE: 7 experts of intermediate 40 (not a power of two), 3 picks renormalised,
    q/k norm, head_dim 24; layer 1 dense (`mlp_only_layers`) between two sparse ones."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=991, hidden_size=80, intermediate_size=112, moe_intermediate_size=40,
        num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-qwen3-moe", cfg)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory) -> str:
    """Qwen2-MoE: qkv bias, a sigmoid-gated shared expert beside 6 experts, 2 picks not
    renormalised, every second layer sparse (`decoder_sparse_step` 2), tied embeddings."""
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=1013, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        shared_expert_intermediate_size=56, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        architectures=["Qwen2MoeForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-qwen2-moe", cfg)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    """Mixtral: 4 experts (checkpoint names w1/w3/w2 under block_sparse_moe), 2 picks,
    3 q / 1 kv heads of head_dim 20, no sliding window."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(
        vocab_size=1019, hidden_size=60, intermediate_size=72, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=512, sliding_window=None,
        tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        architectures=["MixtralForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-mixtral", cfg)


def _deepseek_common() -> dict:
    # MLA of awkward widths: latent rank 24, rope 8, nope 12, v 20 (not the head's 20);
    # 2 shared experts of 16; layer 0 dense, layers 1-2 MoE with 3 picks.
    return dict(
        vocab_size=997, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, kv_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=20, moe_intermediate_size=16, n_shared_experts=2,
        first_k_dense_replace=1, num_experts_per_tok=3,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_deepseek_v2_dir(tmp_path_factory) -> str:
    """DeepSeek-V2 (Lite's form: no q LoRA), greedy softmax routing over 6 experts, scaled
    by 1.5 and not renormalised."""
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(
        **_deepseek_common(), q_lora_rank=None, n_routed_experts=6, topk_method="greedy",
        routed_scaling_factor=1.5, architectures=["DeepseekV2ForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-deepseek-v2", cfg)


@pytest.fixture(scope="session")
def tiny_deepseek_v2_yarn_dir(tmp_path_factory) -> str:
    """DeepSeek-V2 with q LoRA, group-limited routing (2 of 4 groups) and YaRN RoPE with
    mscale_all_dim (the softmax scale's mscale^2)."""
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(
        **_deepseek_common(), q_lora_rank=20, n_routed_experts=8,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32, "beta_slow": 1,
        },
        architectures=["DeepseekV2ForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-deepseek-v2-yarn", cfg)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory) -> str:
    """DeepSeek-V3: sigmoid routing with the correction bias (random, so it changes picks),
    top-2-sum groups, renormalised weights scaled by 2.5, interleaved RoPE."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        **_deepseek_common(), q_lora_rank=20, n_routed_experts=8, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip
    path = _save_tiny(tmp_path_factory, "tiny-deepseek-v3", cfg)
    _randomize_tensors(path, "e_score_correction_bias", scale=0.2)
    return path


def _randomize_tensors(model_dir: str, fragment: str, scale: float) -> None:
    """Replace the saved tensors whose names contain `fragment` (zeros at init) with random
    values, so a test sees whether they are used."""
    from safetensors.torch import load_file, save_file

    (file,) = sorted(Path(model_dir).glob("*.safetensors"))
    tensors = load_file(file)
    g = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if fragment in name:
            tensors[name] = torch.randn(t.shape, generator=g).to(t.dtype) * scale
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def tiny_glm4_moe_dir(tmp_path_factory) -> str:
    """GLM-4-MoE: RoPE over half of each head (head_dim 24: 12 rotated, 12 passed), q/k/v
    bias, per-head q/k norm, V3 routing with a random correction bias, one shared expert,
    layer 0 dense."""
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(
        vocab_size=1021, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5, first_k_dense_replace=1,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, architectures=["Glm4MoeForCausalLM"],
    )  # fmt: skip
    path = _save_tiny(tmp_path_factory, "tiny-glm4-moe", cfg)
    _randomize_tensors(path, "e_score_correction_bias", scale=0.2)
    return path


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> str:
    """Phi-3/4: the checkpoint stores qkv_proj and gate_up_proj fused; RoPE over 3/4 of
    each head (Phi-4-mini's factor), 6 q / 2 kv heads of 16."""
    from transformers import Phi3Config

    cfg = Phi3Config(
        vocab_size=1031, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75},
        sliding_window=None, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Phi3ForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-phi3", cfg)


@pytest.fixture(scope="session")
def tiny_smollm3_dir(tmp_path_factory) -> str:
    """SmolLM3: every fourth layer rotates no position (NoPE, `no_rope_layers`), here
    layer 3 of 4; tied embeddings, 4 q / 2 kv heads of 16."""
    from transformers import SmolLM3Config

    cfg = SmolLM3Config(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["SmolLM3ForCausalLM"],
    )  # fmt: skip
    assert cfg.no_rope_layers == [1, 1, 1, 0]
    return _save_tiny(tmp_path_factory, "tiny-smollm3", cfg)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory) -> str:
    """Granite 3: Llama with four scalars (embeddings x12, residual branches x0.22, softmax
    scale 1/64 instead of 1/sqrt(16), logits / 6), tied embeddings."""
    from transformers import GraniteConfig

    cfg = GraniteConfig(
        vocab_size=1039, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 64,
        logits_scaling=6.0, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, architectures=["GraniteForCausalLM"],
    )  # fmt: skip
    return _save_tiny(tmp_path_factory, "tiny-granite", cfg)


@pytest.fixture(scope="session")
def qwen3_shaped_dir(tmp_path_factory):
    """Qwen3-0.6B's shape (hidden 1024, 16 q / 8 kv heads of 128, vocab 151,936, tied) with
    4 of its 28 layers: the real kernel shapes at a size CI can afford. Stored in bf16
    (435 MB, not 870: a CI run once ran out of disk writing it) and loaded in whatever
    dtype a test asks for, so a float32 test runs on bf16-valued weights on both sides;
    removed when the session ends."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen3ForCausalLM"],
    )
    path = _save_tiny(tmp_path_factory, "qwen3-shaped", cfg, dtype=torch.bfloat16)
    yield path
    shutil.rmtree(path, ignore_errors=True)


VISION_LANGUAGE = re.compile(r"^qwen(2|2_5|3)_vl(_moe)?$")


def hf_reference(model_dir: str) -> Any:
    """transformers' model in float32 on DEVICE, eval mode. A model with an attention logit
    softcap (Gemma 2) gets transformers' eager attention, the only one that applies it:
    5.2x refuses sdpa for Gemma 2, but 5.17 (the GPU image's) runs it by default with the
    softcap dropped. Others keep the default (DeepSeek-V3's eager path fails on the tiny
    test config in both versions)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    softcap = getattr(config, "attn_logit_softcapping", None)
    kw = {"attn_implementation": "eager"} if softcap else {}
    # multimodal checkpoints without a causal-LM class (Qwen2.5-VL, Qwen3-VL): the
    # image-text model, fed text only
    auto = AutoModelForImageTextToText if VISION_LANGUAGE.match(config.model_type) else None
    model = (auto or AutoModelForCausalLM).from_pretrained(model_dir, dtype=torch.float32, **kw)
    return model.to(DEVICE).eval()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), EOS suppressed for
    `max_new_tokens` like our min_tokens, so every output has exactly max_new_tokens."""
    model = hf_reference(model_dir)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=DEVICE)
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def hf_greedy_along(
    model_dir: str, prompts: list[list[int]], outputs: list[list[int]]
) -> list[list[int]]:
    """transformers' greedy choice at each step of `outputs` (an engine's greedy tokens),
    EOS suppressed as in `hf_greedy`: one forward pass over each prompt + output, read at
    every position. For outputs of the length asked for (with EOS suppressed every output
    has it; the caller checks), it returns `outputs` exactly when `hf_greedy` would: greedy
    decoding takes each token from the logits of the prefix before it, and here that prefix
    is the engine's own, so the same choice at every step is the same sequence. One pass a
    prompt, not one a token: SmolLM2's 9 x 32 tokens took 19 s of CPU one token at a time
    (each step reads all 540 MB of its float32 weights)."""
    model = hf_reference(model_dir)
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    choices = []
    with torch.inference_mode():
        for ids, out in zip(prompts, outputs, strict=True):
            x = torch.tensor([ids + out[:-1]], device=DEVICE)
            logits = model(x, attention_mask=torch.ones_like(x)).logits[0, len(ids) - 1 :]
            logits[:, eos] = float("-inf")
            choices.append(logits.argmax(-1).tolist())
    return choices


def assert_logprobs_match_hf(
    model_dir: str, prompt: list[int], new_tokens: int, ref_dir: str | None = None, **llm_kw
) -> None:
    """Greedy-decodes `new_tokens` tokens on our engine (float32, logprobs=1) and checks
    each sampled token's logprob against transformers' log-softmax of its logits for the
    same sequence, run on `ref_dir` (default: the same model). Float32 differs only in
    summation order: 1e-4. Greedy tokens alone can hide a wrong scale; these cannot."""

    from pdserve import LLM, SamplingParams

    llm = LLM(model=model_dir, device=DEVICE, dtype="float32", **llm_kw)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens,
                            logprobs=1)  # fmt: skip
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    model = hf_reference(ref_dir or model_dir)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        logits = model(ids.to(DEVICE)).logits[0].float().cpu()
    want = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(out.token_ids)[:, None]
    )
    got = torch.tensor([[lp[t].logprob] for t, lp in zip(out.token_ids, out.logprobs)])
    assert torch.allclose(got, want, atol=1e-4), (got.squeeze(1), want.squeeze(1))


def assert_greedy_matches_hf(
    model_dir: str,
    prompt_lens: tuple[int, ...],
    new_tokens: int,
    seed: int = 7,
    ref_dir: str | None = None,
    **llm_kw,
) -> Any:
    """Seeded random prompts of `prompt_lens` tokens, decoded greedily on our engine
    (float32, mrv2, 16-token blocks, 64-token steps so long prompts prefill in chunks on a
    cached prefix): each output equals transformers' greedy `generate` on `ref_dir`
    (default: the same model), token for token. Returns the LLM."""
    from pdserve import LLM, SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 990) for _ in range(n)] for n in prompt_lens]
    kw = dict(device=DEVICE, dtype="float32", block_size=16, max_num_batched_tokens=64)
    llm = LLM(model=model_dir, **(kw | llm_kw))
    assert llm.runner_name == "mrv2"
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = hf_greedy(ref_dir or model_dir, prompts, new_tokens)
    for p, out, exp in zip(prompts, outs, expected, strict=True):
        assert out.outputs[0].token_ids == exp, f"mismatch for prompt of {len(p)} tokens"
    return llm


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_lora_adapter(base_dir: str, folder: Path, targets, rank: int, alpha: float, seed: int,
                  rslora: bool = False, where_present: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """A PEFT adapter folder for `base_dir`'s layers (random A and B); returns the merged
    weights' deltas by the base checkpoint's names. `where_present`: only the layers that
    have a target (a hybrid's attention layers), not every layer."""
    import json
    import math

    from safetensors.torch import load_file, save_file

    base = load_file(next(Path(base_dir).glob("*.safetensors")))
    g = torch.Generator().manual_seed(seed)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    tensors, deltas = {}, {}
    layers = 1 + max(int(k.split(".")[2]) for k in base if k.startswith("model.layers."))
    for i in range(layers):
        for t in targets:
            part = "self_attn" if t in ATTN else "mlp"
            if where_present and f"model.layers.{i}.{part}.{t}.weight" not in base:
                continue
            w = base[f"model.layers.{i}.{part}.{t}.weight"]
            a = torch.randn(rank, w.shape[1], generator=g) * 0.3
            b = torch.randn(w.shape[0], rank, generator=g) * 0.3
            prefix = f"base_model.model.model.layers.{i}.{part}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
            deltas[f"model.layers.{i}.{part}.{t}.weight"] = scale * (b @ a)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "use_rslora": rslora, "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return deltas


# ---- hybrid Mamba models (test_mamba_hybrid.py, test_mamba_pd.py) -------------------


def slow_decay(path: str) -> str:
    from safetensors.torch import load_file, save_file

    _randomize_tensors(path, "norm", scale=0.5)
    # Slow decay (|A| 0.02-0.3, time steps ~0.2): the state a token leaves still counts
    # dozens of tokens later, across scan chunks and steps, so carrying it is tested
    (file,) = sorted(Path(path).glob("*.safetensors"))
    tensors = load_file(file)
    g = torch.Generator().manual_seed(9)
    for name, t in tensors.items():
        if name.endswith("A_log"):  # Mamba2's [heads], Mamba1's [d_inner, state]
            tensors[name] = torch.log(torch.linspace(0.02, 0.3, t.numel())).view(t.shape)
        elif name.endswith(("dt_bias", "dt_proj.bias")):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.5 - 1.5
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_bamba_dir(tmp_path_factory) -> str:
    """4 layers (attention at 1 and 3), 8 Mamba heads of 16 in one group (the released
    Bamba's; transformers before 5.2x normalises Bamba's gated output over all its
    features, not per group, which only one group makes the same: the grouped norm is
    NemotronH's test below), state 16, conv 4, 16-token scan chunks (so a prompt's scan
    spans several)."""
    from transformers import BambaConfig

    cfg = BambaConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["BambaForCausalLM"],
    )  # fmt: skip
    return slow_decay(_save_tiny(tmp_path_factory, "tiny-bamba", cfg))


@pytest.fixture(scope="session")
def tiny_nemotron_h_dir(tmp_path_factory) -> str:
    """NemotronH, dense: blocks Mamba2, ReLU^2 MLP, attention (no RoPE), MLP, Mamba2,
    MLP; 8 Mamba heads of 16 in 2 groups (its own config keys)."""
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["NemotronHForCausalLM"],
    )  # fmt: skip
    return slow_decay(_save_tiny(tmp_path_factory, "tiny-nemotron-h", cfg))


@pytest.fixture(scope="session")
def tiny_jamba_dir(tmp_path_factory) -> str:
    """Jamba: Mamba1 layers 0 and 2, attention (no positional embedding) at 1 and 3, an MoE
    of 4 SwiGLU experts (top 2, not renormalised) in layers 0 and 2; d_inner 128, state 8,
    dt rank 8; `slow_decay`, so the state carries across chunks."""
    from transformers import JambaConfig

    cfg = JambaConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=8, max_position_embeddings=512, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["JambaForCausalLM"],
    )  # fmt: skip
    return slow_decay(_save_tiny(tmp_path_factory, "tiny-jamba", cfg))


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory) -> str:
    """Qwen3-Next: Gated DeltaNet layers 0-2 (2 key heads of 8 shared by 4 value heads of
    12, conv 4) and gated attention at 3 (4 q / 2 kv heads of 16, RoPE over a quarter of
    each head); an MoE of 4 experts (top 2, renormalised) with a gated shared expert,
    except layer 1's dense MLP; `slow_decay`, so the state carries across chunks."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_num_key_heads=2, linear_num_value_heads=4, decoder_sparse_step=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts_per_tok=2,
        num_experts=4, norm_topk_prob=True, mlp_only_layers=[1],
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        architectures=["Qwen3NextForCausalLM"],
    )  # fmt: skip
    return slow_decay(_save_tiny(tmp_path_factory, "tiny-qwen3-next", cfg))
