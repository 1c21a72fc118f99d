"""Multi-head latent attention (DeepSeek's MLA) on a paged latent cache.

An MLA layer caches one latent row per token, `[kv_lora_rank + rope_dim]`: the normalised
compressed KV `c` and the rotated shared key `k_pe` (DESIGN §4's `paged_mla` layout,
`[num_blocks, block_size, r + rope]`, no heads). With the key up-projection absorbed into
the query (`q_lat = q_nope @ W_UK`), every head attends the same latent rows: keys are the
whole row, values its first r entries, so MLA is multi-query attention with a key dim of
r + rope and a value dim of r. The caller applies W_UV to the output.

`paged_mla_attention_ref` and `write_latent_ref` are the spec and the CPU path; CUDA
tensors go to kernels/mla_attention_triton.py. An FP8 cache (kernels/fp8_kv.py) holds
`latent / scale`; the caller folds the scale into the softmax scale and the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import mla_attention_triton
from pdserve.kernels.fp8_kv import is_fp8, quantize_ref


def write_latent_ref(
    latent: torch.Tensor,  # [T, r + rope]
    cache: torch.Tensor,  # [num_blocks, block_size, r + rope], updated in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = pad (not written)
    scale: float = 1.0,  # an FP8 cache's
) -> None:
    assert cache.dim() == 3 and latent.shape[1:] == cache.shape[2:], (
        f"latent {tuple(latent.shape)} must be [T, {cache.shape[2]}] for cache {tuple(cache.shape)}"
    )
    keep = slot_mapping >= 0
    flat = cache.view(-1, cache.shape[2])
    rows = latent[keep]
    fp8 = is_fp8(cache.dtype)
    flat[slot_mapping[keep]] = (
        quantize_ref(rows, scale, cache.dtype) if fp8 else rows.to(cache.dtype)
    )


def paged_mla_attention_ref(
    q: torch.Tensor,  # [T, H, r + rope]: absorbed latent query, then the rotated q_pe
    cache: torch.Tensor,  # [num_blocks, block_size, r + rope]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor,  # [T, H, r] out
) -> None:
    """Row r's queries are the last q_len positions of its seq_lens[r]-token context and
    attend causally (as `paged_attention_ref`); rows with seq_len 0 are skipped."""
    assert q.shape[2] == cache.shape[2] and out.shape == (*q.shape[:2], kv_lora_rank), (
        f"q {tuple(q.shape)}, cache {tuple(cache.shape)} and out {tuple(out.shape)} must be "
        f"[T, H, r + rope], [blocks, block_size, r + rope] and [T, H, r={kv_lora_rank}]"
    )
    block_size = cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens[: len(qsl) - 1].tolist()
    for r, ctx in enumerate(lens):
        q_len = qsl[r + 1] - qsl[r]
        if q_len == 0 or ctx == 0:
            continue
        blocks = block_tables[r, : -(-ctx // block_size)].long()
        rows = cache[blocks].reshape(-1, cache.shape[2])[:ctx].to(q.dtype)  # [ctx, r + rope]
        qr = q[qsl[r] : qsl[r + 1]].transpose(0, 1)  # [H, q_len, r + rope]
        keys = rows.unsqueeze(0).expand(qr.shape[0], -1, -1)
        values = keys[..., :kv_lora_rank]
        positions = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= positions  # [q_len, ctx]
        o = F.scaled_dot_product_attention(qr, keys, values, attn_mask=mask, scale=scale)
        out[qsl[r] : qsl[r + 1]] = o.transpose(0, 1)


def write_latent(latent, cache, slot_mapping, scale: float = 1.0) -> None:
    if latent.is_cuda:
        return mla_attention_triton.write_latent_triton(latent, cache, slot_mapping, scale)
    write_latent_ref(latent, cache, slot_mapping, scale)


def paged_mla_attention(
    q, cache, block_tables, query_start_loc, seq_lens, scale, rank, out, max_query_len: int
) -> None:
    if q.is_cuda:
        return mla_attention_triton.paged_mla_attention_triton(
            q, cache, block_tables, query_start_loc, seq_lens, scale, rank, out, max_query_len
        )
    paged_mla_attention_ref(q, cache, block_tables, query_start_loc, seq_lens, scale, rank, out)
