"""Kernel references against independent torch/transformers computations.

Copies and gathers are checked for exact equality; arithmetic against transformers'
modules is exact too where the operation order is the same (RMSNorm, RoPE tables), and
within 2e-6 for attention, whose reduction order legitimately differs from a dense
reference (float32 sums of <= 300 terms; observed error ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.attention import paged_attention, write_kv
from pdserve.kernels.block_table import compute_slot_mapping, gather_block_tables
from pdserve.kernels.input_prep import post_update, prepare_inputs
from pdserve.kernels.norm import fused_add_rms_norm, rms_norm
from pdserve.kernels.rope import apply_rope
from pdserve.runner.models.rope import build_cos_sin_cache, inv_freq_and_scaling

ROPE_VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 3.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 16,
        "mscale": 0.707,
        "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 64,
    },
]


def _llama_config(rope: dict, head_dim: int = 20):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=256,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("rope", ROPE_VARIANTS, ids=lambda r: r["rope_type"])
def test_rope_matches_transformers(rope):
    """Guards the RoPE variant formulas and the cos/sin table layout."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = _llama_config(rope)
    hf = LlamaRotaryEmbedding(cfg)
    inv, scaling = inv_freq_and_scaling(cfg, 20)
    assert torch.equal(inv, hf.inv_freq) and scaling == pytest.approx(hf.attention_scaling)
    pos = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q, k = torch.randn(7, 2, 20), torch.randn(7, 1, 20)
    cos, sin = hf(q, pos[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = apply_rope(q, k, pos, build_cos_sin_cache(cfg, 20, 256))
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), rtol=0, atol=2e-6)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(77, eps=1e-5).to(dtype)
    hf.weight.data = torch.randn(77).to(dtype)
    x, res = torch.randn(9, 77).to(dtype), torch.randn(9, 77).to(dtype)
    assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))
    normed, summed = fused_add_rms_norm(x, res, hf.weight, 1e-5)
    assert torch.equal(summed, res + x) and torch.equal(normed, hf(res + x))


def _dense_reference(q, k_ctx, v_ctx, q_len, scale):
    """Causal attention of the last q_len positions over the full context, GQA by repeat."""
    hq, hk = q.shape[1], k_ctx.shape[1]
    k = k_ctx.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    v = v_ctx.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    ctx = k_ctx.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    s = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("hq,hk,d,bs", [(6, 3, 20, 16), (4, 1, 36, 8), (2, 2, 64, 4)])
def test_paged_attention_matches_dense(hq, hk, d, bs):
    """Guards block-table indexing, prefix offsets, GQA grouping and pad rows: mixed rows
    (decode, chunk after a cached prefix, fresh prompt, pad) over shuffled blocks."""
    torch.manual_seed(0)
    num_blocks, max_blocks = 64, 12
    cache = torch.zeros(num_blocks, 2, bs, hk, d)
    # (context length, query length): decode, chunk on a prefix, fresh prefill, decode at 1
    rows = [(37, 1), (45, 13), (23, 23), (1, 1)]
    perm = torch.randperm(num_blocks - 1) + 1  # block 0 stays the null block
    tables = torch.zeros(len(rows) + 1, max_blocks, dtype=torch.int32)  # +1 pad row
    contexts, cursor = [], 0
    for r, (ctx, _) in enumerate(rows):
        nb = -(-ctx // bs)
        tables[r, :nb] = perm[cursor : cursor + nb].int()
        cursor += nb
        k, v = torch.randn(ctx, hk, d), torch.randn(ctx, hk, d)
        pos = torch.arange(ctx)
        slots = tables[r, pos // bs].long() * bs + pos % bs
        write_kv(k, v, cache, slots)
        contexts.append((k, v))
    qlens = [q for _, q in rows]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in rows] + [0], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, cache, tables, qsl, seq_lens, d**-0.5, out, max(qlens), int(seq_lens.max()))
    for r, ((_, ql), (k, v)) in enumerate(zip(rows, contexts)):
        ref = _dense_reference(q[qsl[r] : qsl[r + 1]], k, v, ql, d**-0.5)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], ref, rtol=0, atol=2e-6)


def test_write_kv_skips_pad_slots():
    cache = torch.zeros(4, 2, 4, 1, 3)
    k, v = torch.ones(3, 1, 3), 2 * torch.ones(3, 1, 3)
    write_kv(k, v, cache, torch.tensor([5, -1, 14]))
    written = (cache[:, 0] != 0).any(-1).any(-1).nonzero().tolist()
    assert written == [[1, 1], [3, 2]]
    assert torch.equal(cache[1, 1, 1], v[0]) and torch.equal(cache[3, 1, 2], v[2])


def test_prepare_inputs_slot_mapping_and_pads():
    """Exact input construction: ids from the token history at computed offsets, positions,
    seq_lens, block-table rows in batch order, slot -1 and zeros for pads."""
    token_ids = torch.arange(4 * 50, dtype=torch.int32).reshape(4, 50)
    block_table = torch.arange(1, 4 * 6 + 1, dtype=torch.int32).reshape(4, 6)
    idx = torch.tensor([2, 0], dtype=torch.int32)  # batch row 0 -> slot 2, row 1 -> slot 0
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    computed = torch.tensor([7, 20], dtype=torch.int32)
    ids, pos = torch.full((6,), -9, dtype=torch.int32), torch.full((6,), -9)
    seq = torch.full((3,), -9, dtype=torch.int32)
    prepare_inputs(idx, qsl, computed, token_ids, ids, pos, seq, 4)
    assert ids.tolist() == [107, 108, 109, 20, 0, 0]
    assert pos.tolist() == [7, 8, 9, 20, 0, 0]
    assert seq.tolist() == [10, 21, 0]
    bt = torch.full((3, 6), -9, dtype=torch.int32)
    gather_block_tables(block_table, idx, bt)
    assert bt.tolist() == [block_table[2].tolist(), block_table[0].tolist(), [0] * 6]
    slots = torch.full((6,), -9)
    compute_slot_mapping(bt, qsl, pos, 4, slots, 4)
    # row 0: positions 7,8,9 -> blocks bt[0][1], bt[0][2]; row 1: position 20 -> bt[1][5]
    assert slots.tolist() == [14 * 4 + 3, 15 * 4 + 0, 15 * 4 + 1, 6 * 4 + 0, -1, -1]


def test_post_update_writes_only_caught_up_rows():
    token_ids = torch.zeros(3, 8, dtype=torch.int32)
    post_update(
        torch.tensor([2, 0], dtype=torch.int32),
        torch.tensor([77, 88]),
        torch.tensor([5, 3], dtype=torch.int32),
        torch.tensor([True, False]),
        token_ids,
    )
    assert token_ids.nonzero().tolist() == [[2, 5]] and token_ids[2, 5] == 77


def test_silu_and_mul_matches_swiglu():
    from pdserve.kernels.activation import silu_and_mul

    x = torch.randn(5, 2 * 13)
    assert torch.equal(silu_and_mul(x), F.silu(x[:, :13]) * x[:, 13:])
