"""Qwen3-Next (runner/models/qwen3_next.py, gated_deltanet.py): Gated DeltaNet layers over
state units, gated attention, MoE with a gated shared expert.

- The blocked delta rule equals the per-token recurrence it stands for (float64), for
  blocks of 1, 3 and 64 tokens, from a nonzero state.
- The engine equals transformers (float32) in greedy tokens and logprobs, through
  chunked prefill that continues from the state, with blocks smaller than a chunk too.
- A mixed step equals its rows alone; PD moves the state and equals one engine.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_matches_hf, assert_logprobs_match_hf
from test_mamba_hybrid import _mixed_step_equals_rows_alone
from test_mamba_pd import VOCAB, _local_pair
from test_pd_engine import GREEDY, _colocated, _prompts, _run, wait_for_tickets

from pdserve.runner.models import gated_deltanet
from pdserve.runner.models.gated_deltanet import GatedDeltaNet, delta_rule_blocks


def _recurrence(q, k, v, beta, g, s):
    """The gated delta rule token by token: S <- e^g S; u = beta (v - S^T k);
    S <- S + k u^T; o = S^T q."""
    out = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        u = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_the_blocked_delta_rule_is_the_recurrence(chunk):
    g = torch.Generator().manual_seed(chunk)
    t, h, dk, dv = 70, 3, 8, 5
    f64 = dict(dtype=torch.float64, generator=g)
    q, k = torch.randn(t, h, dk, **f64), torch.randn(t, h, dk, **f64)
    k = k / k.norm(dim=-1, keepdim=True)  # the model's keys are L2-normalised
    v = torch.randn(t, h, dv, **f64)
    beta = torch.rand(t, h, **f64)
    g_log = -torch.rand(t, h, **f64) * 0.3
    s0 = torch.randn(h, dk, dv, **f64)
    want_o, want_s = _recurrence(q, k, v, beta, g_log, s0)
    o, s = delta_rule_blocks(q, k, v, beta, g_log, s0, chunk)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, want_s, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [64, 8])
def test_qwen3_next_matches_transformers(tiny_qwen3_next_dir, chunk, monkeypatch):
    """Prompts of 5, 40 and 130 tokens prefill in 64-token chunks, each continuing the
    conv and recurrent states; with 8-token blocks a chunk also spans several blocks."""
    monkeypatch.setattr(gated_deltanet, "CHUNK", chunk)
    assert_greedy_matches_hf(tiny_qwen3_next_dir, (5, 40, 130), 8, seed=4)


def test_qwen3_next_logprobs_match_transformers(tiny_qwen3_next_dir):
    """Greedy tokens can hide a wrong gate or norm shift; logprobs cannot."""
    assert_logprobs_match_hf(tiny_qwen3_next_dir, [5, 17, 101, 9, 250, 33, 7, 400], 8)


def test_a_gated_deltanet_mixed_step_equals_its_rows_alone():
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=32, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                          linear_value_head_dim=6, linear_num_key_heads=2,
                          linear_num_value_heads=4, rms_norm_eps=1e-6)  # fmt: skip
    _mixed_step_equals_rows_alone(GatedDeltaNet(cfg, 0), 32)


def test_pd_local_equals_colocated_qwen3_next(tiny_qwen3_next_dir):
    """The DeltaNet layers' conv and recurrent states travel as the Mamba state group."""
    prompts = _prompts(4, VOCAB, seed=6, lo=5, hi=70)
    extra = dict(max_num_batched_tokens=24, block_size=16)
    want = _colocated(tiny_qwen3_next_dir, prompts, **extra)
    prefill, decode = _local_pair(tiny_qwen3_next_dir, **extra)
    assert [g.kind for g in prefill.source.layout.groups] == ["paged_gqa", "mamba_state"]
    for i, p in enumerate(prompts):
        prefill.submit(str(i), p, GREEDY)
    for r in wait_for_tickets(prefill, len(prompts), timeout_s=120):
        decode.submit(r.request_id, prompts[int(r.request_id)], GREEDY, r.ticket)
    assert _run(decode.step, decode.has_work) == want
    assert decode.loader.stats.loads == len(prompts)
    assert decode.loader.stats.recomputes == 0


def test_lora_on_the_gated_attention_equals_the_merged_model(tiny_qwen3_next_dir, tmp_path):
    """An adapter on q/k/v/o of the attention layers: q_proj's delta covers each head's
    query and output-gate rows (both read the adapted projection), o_proj's the gated
    output; tokens equal transformers on the merged weights. An adapter on a Gated
    DeltaNet projection is refused by name."""
    from conftest import ATTN, hf_greedy, make_lora_adapter
    from test_lora import _generate, _llm, _merged

    from pdserve import LoRARequest

    deltas = make_lora_adapter(tiny_qwen3_next_dir, tmp_path / "a", ATTN, 4, 8.0, seed=6,
                               where_present=True)  # fmt: skip
    assert deltas and all(".self_attn." in name for name in deltas)
    merged = _merged(tiny_qwen3_next_dir, deltas, tmp_path / "merged")
    prompts = [[(7 * i + n) % 900 + 3 for i in range(n)] for n in (23, 41)]
    got = _generate(_llm(tiny_qwen3_next_dir), prompts, LoRARequest("a", 1, str(tmp_path / "a")))
    assert got == hf_greedy(merged, prompts, 12)
    # the same adapter's layout, pointed at layer 0's Gated DeltaNet projection
    import json

    from safetensors.torch import save_file

    folder = tmp_path / "deltanet"
    folder.mkdir()
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz"
    ab = {f"{key}.lora_A.weight": torch.zeros(4, 64), f"{key}.lora_B.weight": torch.zeros(8, 4)}
    save_file(ab, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["in_proj_qkvz"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="in_proj_qkvz.lora_A.weight' is not a LoRA A/B"):
        _generate(_llm(tiny_qwen3_next_dir), prompts[:1], LoRARequest("d", 2, str(folder)))


def test_the_released_checkpoints_mtp_layer_is_left_out(tiny_qwen3_next_dir, tmp_path):
    """Released checkpoints carry `mtp.*` tensors (a draft head): they load, unused, and
    the tokens stay transformers'."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    for f in Path(tiny_qwen3_next_dir).iterdir():
        shutil.copy(f, tmp_path / f.name)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(file))
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.mlp.gate.weight"] = torch.randn(4, 64)
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert_greedy_matches_hf(str(tmp_path), (7, 30), 6, seed=5, ref_dir=tiny_qwen3_next_dir)
