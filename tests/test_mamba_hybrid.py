"""Bamba, a hybrid of Mamba2 and attention layers (runner/models/mamba_hybrid.py, mamba2.py), on
mrv2: greedy tokens and logprobs equal transformers' for prompts prefilled in chunks (the
Mamba state carried across steps, the scan across its own chunks), in mixed batches
(prompt chunks beside decode rows), and after preemption (a recomputed request starts
from a zero state). PD: test_mamba_pd.py; prefix caching: test_hybrid_prefix_caching.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    _randomize_tensors,
    _save_tiny,
    assert_greedy_matches_hf,
    assert_logprobs_match_hf,
    slow_decay,
)
from safetensors.torch import load_file, save_file


def _granite_hybrid(tmp_path_factory, name: str, **extra) -> str:
    """Granite 4.0-H: Granite's four multipliers, attention without RoPE at layers 0 and 2
    of 4, Mamba at 1 and 3, a fused shared MLP (and `extra`'s experts)."""
    from transformers import GraniteMoeHybridConfig

    cfg = GraniteMoeHybridConfig(
        vocab_size=1009, hidden_size=64, shared_intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2,
        layer_types=["full_attention", "linear_attention", "full_attention",
                     "linear_attention"],
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=512,
        embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.4,
        logits_scaling=3.0, position_embedding_type="nope", initializer_range=0.1,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        architectures=["GraniteMoeHybridForCausalLM"], **extra,
    )  # fmt: skip
    return slow_decay(_save_tiny(tmp_path_factory, name, cfg))


@pytest.fixture(scope="module")
def tiny_granite_hybrid_dir(tmp_path_factory) -> str:
    """The dense form (H-Micro's)."""
    return _granite_hybrid(tmp_path_factory, "tiny-granite-hybrid", num_local_experts=0)


def test_granite_hybrid_matches_transformers(tiny_granite_hybrid_dir):
    assert_greedy_matches_hf(tiny_granite_hybrid_dir, (3, 40, 77), 16, seed=4)
    assert_logprobs_match_hf(tiny_granite_hybrid_dir, [(5 * i + 1) % 1000 + 3 for i in range(29)],
                             8, block_size=16, max_num_batched_tokens=16)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_granite_moe_dir(tmp_path_factory) -> str:
    """With experts (H-Tiny's form): 4 SwiGLU experts of 48, top 2, beside the shared MLP.
    Saved under the released checkpoints' names (`block_sparse_moe.input_linear`,
    `output_linear`, `router.layer`)."""
    path = _granite_hybrid(tmp_path_factory, "tiny-granite-moe", intermediate_size=48,
                           num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    (file,) = sorted(Path(path).glob("*.safetensors"))
    assert "model.layers.1.block_sparse_moe.input_linear.weight" in load_file(file)
    return path


def test_granite_hybrid_experts_match_transformers(tiny_granite_moe_dir):
    """Routing (top 2 of 4, softmax over the two), the experts' SwiGLU, the shared MLP
    beside them and Granite's residual multiplier on both: greedy tokens and prompt
    logprobs equal transformers', in batches where tokens pick different experts."""
    assert_greedy_matches_hf(tiny_granite_moe_dir, (3, 40, 77), 16, seed=6)
    assert_logprobs_match_hf(tiny_granite_moe_dir, [(11 * i + 2) % 1000 + 3 for i in range(33)],
                             8, block_size=16, max_num_batched_tokens=16)  # fmt: skip


def test_granite_hybrid_experts_read_transformers_5_names(tiny_granite_moe_dir, tmp_path):
    """The same weights under transformers 5's names (`experts.gate_up_proj`,
    `experts.down_proj`, `router.weight`) decode the same tokens."""
    import shutil

    folder = tmp_path / "t5-names"
    shutil.copytree(tiny_granite_moe_dir, folder)
    (file,) = sorted(folder.glob("*.safetensors"))
    renames = (
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
    )
    renamed = {}
    for name, t in load_file(file).items():
        for theirs, ours in renames:
            name = name.replace(theirs, ours)
        renamed[name] = t
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in renamed
    save_file(renamed, file, metadata={"format": "pt"})
    assert_greedy_matches_hf(str(folder), (5, 40), 8, seed=2, ref_dir=tiny_granite_moe_dir)


def test_greedy_tokens_match_transformers(tiny_bamba_dir):
    llm = assert_greedy_matches_hf(tiny_bamba_dir, (1, 9, 40, 90), 20, seed=5)
    assert llm.engine.kv.snapshots is not None  # prefix caching: test_hybrid_prefix_caching
    assert llm.engine.execution_path["runner"] == "mrv2"


def test_logprobs_match_transformers(tiny_bamba_dir):
    assert_logprobs_match_hf(tiny_bamba_dir, [(7 * i + 3) % 1000 + 3 for i in range(37)], 10,
                             block_size=16, max_num_batched_tokens=16)  # fmt: skip


def test_preempted_requests_restart_from_a_zero_state(tiny_bamba_dir):
    """A KV cache too small for the batch: requests are preempted and recomputed, and
    their Mamba state must restart with them."""
    llm = assert_greedy_matches_hf(tiny_bamba_dir, (30, 41, 35, 28), 24, seed=8,
                                   num_gpu_blocks=10, max_model_len=100)  # fmt: skip
    assert llm.engine.scheduler.num_preemptions > 0


def test_nemotron_h_matches_transformers(tiny_nemotron_h_dir):
    assert_greedy_matches_hf(tiny_nemotron_h_dir, (2, 33, 70), 16, seed=3)
    assert_logprobs_match_hf(tiny_nemotron_h_dir, [(3 * i + 7) % 1000 + 3 for i in range(31)],
                             8, block_size=16, max_num_batched_tokens=16)  # fmt: skip


def test_nemotron_h_reads_its_released_names(tiny_nemotron_h_dir, tmp_path):
    """NVIDIA's checkpoints name the base model `backbone` (embeddings, norm_f): the same
    weights under those names decode the same tokens."""
    import shutil

    folder = tmp_path / "backbone"
    shutil.copytree(tiny_nemotron_h_dir, folder)
    (file,) = sorted(folder.glob("*.safetensors"))
    tensors = load_file(file)
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = "backbone." + name.removeprefix("model.")
            name = name.replace("backbone.embed_tokens.", "backbone.embeddings.")
            name = name.replace("backbone.norm.", "backbone.norm_f.")
        renamed[name] = t
    assert "backbone.embeddings.weight" in renamed and "backbone.norm_f.weight" in renamed
    save_file(renamed, file, metadata={"format": "pt"})
    assert_greedy_matches_hf(str(folder), (5, 40), 8, seed=2, ref_dir=tiny_nemotron_h_dir)


def _nemotron_moe(tmp_path_factory, name: str, **extra) -> str:
    """NemotronH with MoE blocks (Nemotron 3 Nano's form): 8 relu^2 experts of 32 in 2
    groups, top 2 from the best group, scaled by 2.5, and a shared expert of 48; a random
    correction bias, so it changes which experts win."""
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(
        vocab_size=1009, hidden_size=64, intermediate_size=96,
        layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["NemotronHForCausalLM"], **extra,
    )  # fmt: skip
    path = slow_decay(_save_tiny(tmp_path_factory, name, cfg))
    _randomize_tensors(path, "e_score_correction_bias", scale=0.3)
    (file,) = sorted(Path(path).glob("*.safetensors"))
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in load_file(file)
    return path


@pytest.fixture(scope="module")
def tiny_nemotron_moe_dir(tmp_path_factory) -> str:
    return _nemotron_moe(tmp_path_factory, "tiny-nemotron-moe")


def test_nemotron_h_experts_match_transformers(tiny_nemotron_moe_dir):
    """Group-limited sigmoid routing with its correction bias, the relu^2 experts read one
    by one from the released names, the scaling and the shared expert: greedy tokens and
    prompt logprobs equal transformers'."""
    assert_greedy_matches_hf(tiny_nemotron_moe_dir, (2, 33, 70), 16, seed=3)
    assert_logprobs_match_hf(tiny_nemotron_moe_dir, [(5 * i + 4) % 1000 + 3 for i in range(31)],
                             8, block_size=16, max_num_batched_tokens=16)  # fmt: skip


def test_nemotron_h_latent_experts_match_transformers(tmp_path_factory):
    """`moe_latent_size`: the experts work in a 24-wide latent between two projections."""
    path = _nemotron_moe(tmp_path_factory, "tiny-nemotron-latent", moe_latent_size=24)
    assert_greedy_matches_hf(path, (4, 37), 12, seed=5)
    assert_logprobs_match_hf(path, [(7 * i + 5) % 1000 + 3 for i in range(21)], 6)


def test_nemotron_h_experts_read_transformers_5_names(tiny_nemotron_moe_dir, tmp_path):
    """The experts stacked (`mixer.experts.up_proj` [E, I, H]), as transformers 5 keeps
    them in memory: the same tokens."""
    import re
    import shutil

    import torch

    folder = tmp_path / "stacked"
    shutil.copytree(tiny_nemotron_moe_dir, folder)
    (file,) = sorted(folder.glob("*.safetensors"))
    tensors, parts = {}, {}
    for name, t in load_file(file).items():
        m = re.match(r"(.*mixer\.experts\.)(\d+)\.(up|down)_proj\.weight$", name)
        if m is None:
            tensors[name] = t
        else:
            parts.setdefault(f"{m.group(1)}{m.group(3)}_proj", {})[int(m.group(2))] = t
    for name, experts in parts.items():
        tensors[name] = torch.stack([experts[e] for e in range(len(experts))])
    assert "backbone.layers.5.mixer.experts.down_proj" in tensors
    save_file(tensors, file, metadata={"format": "pt"})
    assert_greedy_matches_hf(str(folder), (5, 40), 8, seed=2, ref_dir=tiny_nemotron_moe_dir)


def _mixed_step_equals_rows_alone(mixer, hidden: int) -> None:
    """One step of prompt chunks and one-token rows (decodes, and a one-token prompt) in any
    order, on units that are not the row numbers: each row's output and its state equal
    those of the row run alone (the one-token rows take the batched recurrence, the others
    the scan)."""
    import numpy as np
    import torch

    from pdserve.runner.models.mamba2 import MambaStep

    torch.manual_seed(0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)
    (conv_shape, ssm_shape) = mixer.state_shapes
    counts = np.array([5, 1, 7, 1, 1, 10])
    fresh = np.array([False, False, True, True, False, False])
    units = torch.tensor([3, 0, 4, 1, 2, 5])
    conv0, ssm0 = torch.randn(6, *conv_shape), torch.randn(6, *ssm_shape)
    x = torch.randn(int(counts.sum()), hidden)
    qs = np.concatenate([[0], np.cumsum(counts)])

    def run(rows):
        conv, ssm = conv0.clone(), ssm0.clone()
        sub_qs = np.concatenate([[0], np.cumsum(counts[rows])])
        xs = torch.cat([x[qs[r] : qs[r + 1]] for r in rows])
        f = fresh[rows]
        step = MambaStep(units[rows], sub_qs, f, torch.from_numpy(f))
        with torch.no_grad():
            return mixer(xs, step, conv, ssm), conv, ssm

    together, conv_all, ssm_all = run(list(range(6)))
    for r in range(6):
        alone, conv_r, ssm_r = run([r])
        torch.testing.assert_close(together[qs[r] : qs[r + 1]], alone, rtol=1e-5, atol=1e-5)
        u = int(units[r])
        torch.testing.assert_close(conv_all[u], conv_r[u])
        torch.testing.assert_close(ssm_all[u], ssm_r[u], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan_bytes", [1, 256 << 20])
def test_a_mamba2_mixed_step_equals_its_rows_alone(scan_bytes, monkeypatch):
    """Mamba2's prompt rows scan together, padded to the longest row of their scan-chunk
    count (the shorter row's pads must leave its state alone), or one a group when the
    group's scan budget holds a single row."""
    from transformers import BambaConfig

    from pdserve.runner.models import mamba2
    from pdserve.runner.models.mamba2 import Mamba2Mixer

    monkeypatch.setattr(mamba2, "SCAN_BYTES", scan_bytes)
    cfg = BambaConfig(hidden_size=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=4)  # fmt: skip
    _mixed_step_equals_rows_alone(Mamba2Mixer(cfg, 0), 32)


def test_a_mamba1_mixed_step_equals_its_rows_alone():
    from transformers import JambaConfig

    from pdserve.runner.models.mamba1 import Mamba1Mixer

    cfg = JambaConfig(hidden_size=32, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                      mamba_dt_rank=4)  # fmt: skip
    _mixed_step_equals_rows_alone(Mamba1Mixer(cfg, 0), 32)


def test_mamba_state_dtypes_follow_vllms_flags(tiny_bamba_dir):
    """`mamba_cache_dtype` / `mamba_ssm_cache_dtype` (vLLM's names): the SSM state defaults
    to float32; "auto" follows the conv state, which follows the model; a 16-bit SSM state
    rounds each step's state and stays close (16-bit rounding of a state that decays over
    tens of tokens: logprobs within 0.05), and a bad name is refused."""
    import torch

    from pdserve import LLM, SamplingParams
    from pdserve.runner.config import CacheConfig

    prompts = [{"prompt_token_ids": [(13 * i + 5) % 1000 + 3 for i in range(40)]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=tiny_bamba_dir, device="cpu", max_model_len=256, **kw)
        conv, ssm = llm.engine.runner.model.mamba_states
        out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
        return (
            (conv.dtype, ssm.dtype),
            out.token_ids,
            [next(iter(lp.values())).logprob for lp in out.logprobs],
        )

    dtypes, tokens, lps = run()
    assert dtypes == (torch.float32, torch.float32)
    dtypes16, tokens16, lps16 = run(mamba_ssm_cache_dtype="bfloat16")
    assert dtypes16 == (torch.float32, torch.bfloat16)
    assert tokens16 == tokens
    diff = max(abs(a - b) for a, b in zip(lps, lps16, strict=True))
    assert 0 < diff < 0.05, diff
    assert run(mamba_cache_dtype="bfloat16", mamba_ssm_cache_dtype="auto")[0] == (
        torch.bfloat16, torch.bfloat16,
    )  # fmt: skip
    assert CacheConfig().mamba_dtypes(torch.bfloat16) == (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of"):
        LLM(model=tiny_bamba_dir, device="cpu", mamba_ssm_cache_dtype="fp8")


def test_jamba_matches_transformers(tiny_jamba_dir):
    """Jamba (Mamba1, runner/models/mamba1.py): the per-channel selective scan with its dt,
    B and C norms, carried across prompt chunks and decode steps; attention without RoPE;
    MoE layers without renormalisation. Greedy tokens and prompt logprobs equal
    transformers'."""
    assert_greedy_matches_hf(tiny_jamba_dir, (1, 9, 40, 90), 16, seed=5)
    assert_logprobs_match_hf(tiny_jamba_dir, [(7 * i + 3) % 1000 + 3 for i in range(37)], 8,
                             block_size=16, max_num_batched_tokens=16)  # fmt: skip
