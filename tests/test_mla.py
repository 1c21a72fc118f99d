"""MLA (DeepSeek-V2/V3) on the MRV2 runner beyond parity with transformers
(`test_parity_hf.py`): the absorbed paged attention against the expanded definition, the
latent cache's layout (one `paged_mla` row per token and layer), the engine's
self-consistency on it, and PD moving real latent pages between engines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_pd_engine import GREEDY, _pd, _prompts, _run

from pdserve import LLM, SamplingParams
from pdserve.decode.worker import DecodeWorker
from pdserve.kernels.mla_attention import paged_mla_attention_ref, write_latent_ref
from pdserve.kvtransfer.layout import PagedMLAGroup
from pdserve.kvtransfer.transport_local import LocalRegistry, LocalTransport
from pdserve.kvtransfer.transport_tcp import TcpTransport
from pdserve.prefill.worker import PrefillWorker
from pdserve.runner.engine import Engine
from pdserve.runner.runner_select import mrv2_unsupported_features


def _kw(model: str, **extra) -> dict:
    # On the CPU wherever the tests run: mrv2 runs MLA there only (no device kernels yet).
    return dict(model=model, dtype="float32", device="cpu", **extra)


def _colocated(model: str, prompts) -> dict:
    engine = Engine.from_args(**_kw(model))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    return _run(engine.step, engine.has_unfinished)


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


def test_mla_is_refused_on_cuda_and_runs_mrv2_on_cpu(tiny_deepseek_v2_dir):
    """The honest path: with no MLA device kernels, an operator on a GPU is told that MLA
    falls back to the reference runner instead of running unpaged without a word."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_deepseek_v2_dir)
    assert mrv2_unsupported_features(cfg, "cpu") == []
    (problem,) = mrv2_unsupported_features(cfg, "cuda:0")
    assert "MLA attention on CUDA" in problem


def test_latent_cache_holds_one_row_per_token_and_layer(tiny_deepseek_v3_dir):
    """The `paged_mla` layout of DESIGN §4: `[L, blocks, block_size, r + rope]`, 32 floats a
    token and layer here where per-head K/V would take 4 x (20 + 20)."""
    engine = Engine.from_args(**_kw(tiny_deepseek_v3_dir, block_size=16))
    assert engine.execution_path["experts"] == "torch"
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

    kw = {"model": tiny_deepseek_v2_yarn_dir, "device": "cpu", "dtype": "float32"}
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
    registry = LocalRegistry()
    engine = Engine.from_args(**_kw(tiny_deepseek_v3_dir))
    prefill = PrefillWorker(engine, "P0", registry=registry)
    transports = {"local": LocalTransport(registry, prefill.source.layout_hash)}
    decode = DecodeWorker(_kw(tiny_deepseek_v3_dir), "D0", transports)
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
