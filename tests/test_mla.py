"""MLA (DeepSeek-V2/V3) on the MRV2 runner beyond parity with transformers
(`test_parity_hf.py`): the absorbed paged attention against the expanded definition, the
latent cache's layout (one `paged_mla` row per token and layer), the engine's
self-consistency on it, and PD moving real latent pages between engines.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from test_pd_engine import _colocated, _kw, _local_pair, _pd, _prompts

from pdserve import LLM, SamplingParams
from pdserve.decode.worker import DecodeWorker
from pdserve.kernels.mla_attention import paged_mla_attention_ref, write_latent_ref
from pdserve.kernels.mla_attention_triton import paged_mla_attention_triton, write_latent_triton
from pdserve.kvtransfer.layout import PagedMLAGroup
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillWorker
from pdserve.runner.engine import Engine


def test_absorbed_paged_attention_equals_expanded_heads():
    """Guards the absorption and the paging: per-head keys [c W_UK^T | k_pe] and values
    c W_UV^T over the context in order must give what the latent query over shuffled
    cache blocks gives once W_UV is applied (a wrong block, position or causal limit, or
    values read past r, changes the result by O(1))."""
    g = torch.Generator().manual_seed(0)
    heads, nope, rope, rank, v_dim, bs = 3, 12, 8, 24, 20, 4
    ctx_lens, q_lens = [9, 5, 13], [3, 1, 13]  # a chunk after a prefix, a decode, a prefill
    w_uk = torch.randn(heads, nope, rank, generator=g)
    w_uv = torch.randn(heads, v_dim, rank, generator=g)
    cache = torch.randn(16, bs, rank + rope, generator=g)  # garbage outside the tables
    tables = torch.zeros(3, 4, dtype=torch.int32)
    free = torch.randperm(15, generator=g) + 1
    latents, used = [], 0
    for r, ctx in enumerate(ctx_lens):
        blocks = free[used : used + -(-ctx // bs)]
        used += len(blocks)
        tables[r, : len(blocks)] = blocks.to(torch.int32)
        rows = torch.randn(ctx, rank + rope, generator=g)
        cache[blocks] = torch.cat([rows, cache[blocks].view(-1, rank + rope)[ctx:]]).view(
            len(blocks), bs, -1
        )
        latents.append(rows)
    qsl = torch.tensor([0, 3, 4, 17], dtype=torch.int32)
    q_nope = torch.randn(17, heads, nope, generator=g)
    q_pe = torch.randn(17, heads, rope, generator=g)
    scale = 0.17
    out = torch.zeros(17, heads, rank)
    q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], -1)
    paged_mla_attention_ref(
        q, cache, tables, qsl, torch.tensor(ctx_lens, dtype=torch.int32), scale, rank, out
    )
    got = torch.einsum("thr,hvr->thv", out, w_uv)
    for r, (ctx, q_len) in enumerate(zip(ctx_lens, q_lens)):
        c, k_pe = latents[r].split([rank, rope], -1)
        keys = torch.cat([torch.einsum("sr,hdr->hsd", c, w_uk), k_pe.expand(heads, -1, -1)], -1)
        values = torch.einsum("sr,hvr->hsv", c, w_uv)
        qr = torch.cat([q_nope, q_pe], -1)[qsl[r] : qsl[r + 1]].transpose(0, 1)
        pos = torch.arange(q_len).unsqueeze(1) + ctx - q_len
        mask = torch.arange(ctx).unsqueeze(0) <= pos
        want = F.scaled_dot_product_attention(qr, keys, values, attn_mask=mask, scale=scale)
        assert torch.allclose(got[qsl[r] : qsl[r + 1]], want.transpose(0, 1), atol=1e-4), r


def test_write_latent_skips_pad_slots():
    cache = torch.zeros(3, 4, 6)
    latent = torch.arange(18, dtype=torch.float32).view(3, 6)
    write_latent_ref(latent, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(cache[1, 1], latent[0]) and torch.equal(cache[0, 0], latent[2])
    assert int((cache != 0).any(-1).sum()) == 2, "the pad row wrote nothing"


def test_latent_cache_holds_one_row_per_token_and_layer(tiny_deepseek_v3_dir):
    """The `paged_mla` layout of DESIGN §4: `[L, blocks, block_size, r + rope]`, 32 floats a
    token and layer here where per-head K/V would take 4 x (20 + 20)."""
    engine = Engine.from_args(**_kw(tiny_deepseek_v3_dir, block_size=16))
    assert engine.execution_path["experts"] == ("triton" if DEVICE == "cuda" else "torch")
    assert engine.execution_path["decode_attention"] == "mla"
    cache = engine.runner.kv_cache
    assert cache.shape[0] == 3 and cache.shape[2:] == (16, 24 + 8)
    prefill = PrefillWorker(engine, "P0")
    try:
        (group,) = prefill.source.layout.groups
        assert group == PagedMLAGroup("kv", 3, 16, 24, 8, "float32")
        assert group.unit_bytes() == 3 * 16 * 32 * 4  # a block over the 3 layers
    finally:
        prefill.close()


def test_mla_engine_is_self_consistent(tiny_deepseek_v2_yarn_dir):
    """Chunked vs whole prefill and prefix-cache hit vs miss give the same tokens on the
    latent cache (chunk boundaries and cached latents read back through block tables)."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, 990, seed=4, lo=20, hi=90)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)

    def tokens(llm, ps):
        return [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]

    kw = {"model": tiny_deepseek_v2_yarn_dir, "device": DEVICE, "dtype": "float32"}
    whole = LLM(**kw, max_num_batched_tokens=2048)
    want = tokens(whole, prompts)
    assert tokens(LLM(**kw, max_num_batched_tokens=16), prompts) == want
    shared = [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:40] + [7, 8, 9]}]
    hit = whole.generate(shared, greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 32, "the second run hit the cached latent blocks"
    cold = LLM(**kw, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == tokens(cold, shared)[0]


def test_pd_moves_latent_pages_local_and_tcp(tiny_deepseek_v3_dir):
    """Prefill on one engine, the latent pages pulled by another (in-process, then over a
    real ZMQ socket layer by layer), decoding equals one engine doing both: a page or layer
    mix-up in the `paged_mla` group changes greedy tokens."""
    prompts = _prompts(5, 990, seed=3, lo=3, hi=70)
    want = _colocated(tiny_deepseek_v3_dir, prompts)
    prefill, decode = _local_pair(tiny_deepseek_v3_dir)
    assert _pd(prefill, decode, prompts) == want
    assert decode.loader.stats.loads == len(prompts) and decode.loader.stats.recomputes == 0
    prefill = PrefillWorker(Engine.from_args(**_kw(tiny_deepseek_v3_dir)), "P1")
    try:
        transport = TcpTransport("D1", prefill.source.layout, layer_wise=True)
        decode = DecodeWorker(_kw(tiny_deepseek_v3_dir), "D1", {"tcp": transport})
        assert _pd(prefill, decode, prompts) == want
        assert decode.loader.stats.bytes_pulled > 0
        assert prefill.server.counts["errors"] == 0
    finally:
        prefill.close()


def _mla_batch(heads, rank, rope, bs, rows, dtype, seed):
    """A paged latent cache with rows of (context, queries): shuffled blocks, garbage in
    unused slots and blocks, one pad row (context 0) if asked by a (0, 1) entry."""
    g = torch.Generator().manual_seed(seed)
    width = rank + rope
    need = sum(-(-ctx // bs) for ctx, _ in rows)
    cache = torch.randn(need + 3, bs, width, generator=g)
    order = (torch.randperm(need + 2, generator=g) + 1).tolist()
    max_blocks = max(1, max(-(-ctx // bs) for ctx, _ in rows))
    tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    for r, (ctx, _) in enumerate(rows):
        n = -(-ctx // bs)
        tables[r, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    qsl = torch.tensor([0] + [q for _, q in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), heads, width, generator=g)
    seq_lens = torch.tensor([ctx for ctx, _ in rows], dtype=torch.int32)
    return (t.to(DEVICE) for t in (q.to(dtype), cache.to(dtype), tables, qsl, seq_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,rank,rope,bs,rows",
    [
        (4, 24, 8, 4, [(9, 3), (5, 1), (13, 13), (0, 1)]),  # chunk, decode, prefill, pad
        (3, 40, 12, 16, [(1, 1), (37, 37), (20, 2)]),  # odd widths, heads not a power of 2
        (20, 32, 16, 8, [(30, 1), (7, 1)]),  # more heads than a program's 16
    ],
)
def test_triton_mla_matches_reference(heads, rank, rope, bs, rows, dtype):
    """Guards the kernel's tiles: heads x queries on M, masked rank/rope tails, causal
    limits per query inside a tile, block-table lookups per key, pad rows written as
    zeros (the reference leaves them; the runner discards them)."""
    q, cache, tables, qsl, seq_lens = _mla_batch(heads, rank, rope, bs, rows, dtype, seed=heads)
    want = torch.zeros(q.shape[0], heads, rank, dtype=dtype, device=DEVICE)
    paged_mla_attention_ref(q, cache, tables, qsl, seq_lens, 0.3, rank, want)
    got = torch.full_like(want, float("nan"))
    max_q = max(n for _, n in rows)
    paged_mla_attention_triton(q, cache, tables, qsl, seq_lens, 0.3, rank, got, max_q)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), float(
        (got.float() - want.float()).abs().max()
    )
    write = torch.zeros(cache.shape, dtype=dtype, device=DEVICE)
    latent = torch.randn(5, rank + rope).to(DEVICE, dtype)
    slots = torch.tensor([3, -1, 0, bs + 1, -1], device=DEVICE)
    write_latent_triton(latent, write, slots)
    want_write = torch.zeros_like(write)
    write_latent_ref(latent, want_write, slots)
    assert torch.equal(write, want_write)
