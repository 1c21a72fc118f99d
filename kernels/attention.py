"""Paged attention over the KV cache: the KV write and one varlen attention call.

Cache layout per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (K at
index 0, V at 1). `paged_attention` serves prefill chunks (causal within the chunk,
attending to the cached prefix) and decode rows in one call; a row's context is its
`seq_len` tokens, read through its block-table row. Pad rows have `seq_len == 0`.

The reference below is the CPU path: decode rows (one query each) go through one
batched SDPA call with a length mask; rows with several queries run one SDPA call each
(a padded batch would cost O(R * max_q * max_kv) memory when one long prefill shares the
step with many decodes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.fp8_kv import is_fp8, quantize_ref
from pdserve.kernels.paged_attention_triton import paged_attention_triton
from pdserve.kernels.workspace import KernelWorkspace


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D], updated in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's (k_scale, v_scale)
) -> None:
    block_size = kv_cache.shape[2]
    n = slot_mapping.numel()
    valid = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    fp8 = is_fp8(kv_cache.dtype)
    for i, (x, scale) in enumerate(((key, scales[0]), (value, scales[1]))):
        rows = x[:n][valid]
        kv_cache[blocks, i, offsets] = (
            quantize_ref(rows, scale, kv_cache.dtype) if fp8 else rows.to(kv_cache.dtype)
        )


def write_kv(key, value, kv_cache, slot_mapping, scales: tuple[float, float] = (1.0, 1.0)):
    """K and V of each token into its slot (an FP8 cache: divided by `scales`)."""
    assert key.shape == value.shape and key.shape[1:] == kv_cache.shape[3:], (
        f"key/value [T, Hkv, D] must match the cache's heads/dim (got {tuple(key.shape)} vs {tuple(kv_cache.shape)})"
    )
    from pdserve.kernels.kv_write import write_kv_triton

    fn = write_kv_triton if kv_cache.is_cuda else write_kv_ref
    fn(key, value, kv_cache, slot_mapping, scales)


def _gather_context(kv_cache, block_row, num_ctx):
    # -> K, V: [num_ctx, Hkv, D] read through one block-table row.
    block_size = kv_cache.shape[2]
    nb = -(-num_ctx // block_size)
    kv = kv_cache[block_row[:nb].long()]  # [nb, 2, bs, Hkv, D]
    k = kv[:, 0].reshape(nb * block_size, *kv.shape[3:])[:num_ctx]
    v = kv[:, 1].reshape(nb * block_size, *kv.shape[3:])[:num_ctx]
    return k, v


def first_visible(pos: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position a query at `pos` sees: 0 (full attention), `pos - window + 1`
    (a sliding window, `window > 0`), or its chunk's first, `pos - pos % -window` (chunked
    attention, `window < 0`); kernels/attention_parts.py's `first_visible_key`."""
    if window > 0:
        return (pos - window + 1).clamp(min=0)
    if window < 0:
        return pos - pos % -window
    return torch.zeros_like(pos)


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R_pad, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R_pad] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D] out
    max_query_len: int,  # host-known bounds: size grids without reading the device
    max_seq_len: int,
    window: int = 0,  # > 0: sliding window, query p sees keys (p - window, p]; < 0: chunks
    softcap: float = 0.0,  # > 0: attention logit softcapping
    sinks: torch.Tensor | None = None,  # [Hq]: a sink logit per query head
) -> None:
    """The spec. Row r's queries are tokens `qsl[r]:qsl[r+1]`, the LAST q_len positions of
    its `seq_lens[r]`-token context (keys read through `block_tables[r]`); query i sits at
    position `seq_len - q_len + i` and attends keys `0..position` (causal). Query head h
    reads kv head `h // (Hq // Hkv)`. Rows with `seq_len == 0` (pad rows) are skipped here
    (`out` untouched); the Triton path writes zeros there. `max_query_len` / `max_seq_len`
    bound the rows' query and context lengths (the Triton path sizes its grids from them).
    With `window > 0` (sliding-window attention, transformers' convention) query position
    p attends keys `p - window + 1..p` only; with `window < 0` (chunked attention, Llama 4's
    local layers) keys from the start of its block of `-window` positions, `p - p % -window`,
    to p (`first_visible`). With `softcap > 0` (Gemma 2) the scaled scores
    become `softcap * tanh(scores / softcap)` before the softmax. With `sinks` (gpt-oss)
    each query head's softmax has one more logit, `sinks[h]`, in its denominator only.
    """
    if softcap or sinks is not None:
        _explicit_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, out,
                      window, softcap, sinks)  # fmt: skip
        return
    num_reqs = query_start_loc.numel() - 1
    qsl = query_start_loc.tolist()
    lens = seq_lens[:num_reqs].tolist()
    decode_rows = [r for r in range(num_reqs) if qsl[r + 1] - qsl[r] == 1 and lens[r] > 0]
    if decode_rows:
        _decode_batch(q, kv_cache, block_tables, qsl, lens, decode_rows, scale, out, window)
    for r in range(num_reqs):
        q_len, ctx = qsl[r + 1] - qsl[r], lens[r]
        if q_len <= 1 or ctx == 0:
            continue
        k, v = _gather_context(kv_cache, block_tables[r], ctx)
        qr = q[qsl[r] : qsl[r + 1]].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        kr = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
        vr = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        prefix = ctx - q_len  # tokens already cached before this chunk
        if prefix == 0 and (window == 0 or abs(window) >= ctx):
            o = F.scaled_dot_product_attention(
                qr, kr, vr, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            qpos = torch.arange(q_len, device=q.device).unsqueeze(1) + prefix
            kpos = torch.arange(ctx, device=q.device).unsqueeze(0)
            mask = (kpos <= qpos) & (kpos >= first_visible(qpos, window))  # [q_len, ctx]
            o = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[qsl[r] : qsl[r + 1]] = o.squeeze(0).transpose(0, 1)


def _explicit_ref(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, out,
                  window, softcap, sinks) -> None:  # fmt: skip
    """The spec with softcapping or sinks: one row at a time, scores written out (SDPA has
    neither)."""
    qsl = query_start_loc.tolist()
    for r in range(query_start_loc.numel() - 1):
        q_len, ctx = qsl[r + 1] - qsl[r], int(seq_lens[r])
        if q_len == 0 or ctx == 0:
            continue
        k, v = _gather_context(kv_cache, block_tables[r], ctx)
        group = q.shape[1] // k.shape[1]
        k = k.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = v.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        s = q[qsl[r] : qsl[r + 1]].transpose(0, 1) @ k.transpose(1, 2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap  # [Hq, q_len, ctx]
        qpos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        visible = (kpos <= qpos) & (kpos >= first_visible(qpos, window))
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head, dropped after the softmax
            sink = sinks.to(s.dtype)[:, None, None].expand(-1, q_len, 1)
            s = torch.cat([s, sink], dim=-1)
        p = s.softmax(-1)[..., :ctx]
        out[qsl[r] : qsl[r + 1]] = (p @ v).transpose(0, 1).to(out.dtype)


def _decode_batch(q, kv_cache, block_tables, qsl, lens, rows, scale, out, window) -> None:
    block_size = kv_cache.shape[2]
    max_ctx = max(lens[r] for r in rows)
    nb = -(-max_ctx // block_size)
    idx = torch.tensor(rows, device=q.device)
    kv = kv_cache[block_tables[idx, :nb].long()]  # [n, nb, 2, bs, Hkv, D]
    n = len(rows)
    k = kv[:, :, 0].reshape(n, nb * block_size, *kv.shape[4:]).transpose(1, 2).to(q.dtype)
    v = kv[:, :, 1].reshape(n, nb * block_size, *kv.shape[4:]).transpose(1, 2).to(q.dtype)
    tok = torch.tensor([qsl[r] for r in rows], device=q.device)
    qd = q[tok].unsqueeze(2)  # [n, Hq, 1, D]
    ctx = torch.tensor([lens[r] for r in rows], device=q.device)
    kpos = torch.arange(nb * block_size, device=q.device).unsqueeze(0)
    newest = ctx.unsqueeze(1) - 1  # each row's query position
    mask = (kpos <= newest) & (kpos >= first_visible(newest, window))
    # Slots past a row's context hold whatever the block had (a failed transfer can leave
    # NaN bits there): NaN + (-inf) is NaN in the scores and 0 x NaN is NaN in P @ V, so
    # both K and V are zeroed there (the Triton kernel never loads them).
    keep = mask[:, None, :, None]
    k, v = k.masked_fill(~keep, 0), v.masked_fill(~keep, 0)
    o = F.scaled_dot_product_attention(
        qd, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    out[tok] = o.squeeze(2)


def paged_attention(
    q,
    kv_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    out,
    max_query_len,
    max_seq_len,
    workspace: KernelWorkspace | None = None,
    decode_kernel: str | None = None,  # the Triton path's decode kernel; None = by shape
    window: int = 0,  # > 0: sliding-window attention over the last `window` keys; < 0: chunks
    softcap: float = 0.0,  # > 0: attention logit softcapping (Gemma 2)
    sinks: torch.Tensor | None = None,  # [Hq] float32 attention sinks (gpt-oss)
    row_slots: torch.Tensor | None = None,  # [R_pad] int32 request slot of each row
    max_run: int = 1,  # k + 1 with k-token drafts: how the Triton path schedules drafted rows
) -> None:
    """Each row's attention (the reference's function). `row_slots` and `max_run` change
    only which program computes what (kernels/paged_decode_split.py), not the result."""
    assert q.dim() == 3 and kv_cache.dim() == 5, "q is [T, Hq, D]; a layer's cache is 5-D"
    assert q.shape[1] % kv_cache.shape[3] == 0, "query heads must be a multiple of kv heads"
    args = (q, kv_cache, block_tables, query_start_loc, seq_lens, scale, out)
    if q.is_cuda:
        paged_attention_triton(
            *args, max_query_len, max_seq_len, workspace=workspace, decode_kernel=decode_kernel,
            window=window, softcap=softcap, sinks=sinks, row_slots=row_slots, max_run=max_run,
        )  # fmt: skip
    else:
        paged_attention_ref(*args, max_query_len, max_seq_len, window, softcap, sinks)
