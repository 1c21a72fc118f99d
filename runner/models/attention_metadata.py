"""Per-step attention inputs, passed explicitly to every attention layer (no global context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R + 1] int32: row r's queries are tokens [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor  # [R_pad] int32: context length of each row after this step
    block_tables: torch.Tensor  # [R_pad, max_blocks] int32: pad rows all zero
    slot_mapping: torch.Tensor  # [T_pad] int64: KV slot of each token, -1 for pads
    max_query_len: int  # host-known bounds, so kernels size grids without a device read
    max_seq_len: int
    # The decode attention kernel ("per_head" | "packed" | "flat" | "per_head_prep",
    # kernels/paged_attention_triton.py chooses; models/llama.py's `prepare_attend` fuses
    # the preparation for "per_head_prep" and None where kernels/qkv_attend.applies);
    # None: the kernels' own choice by batch shape.
    decode_kernel: str | None = None
    # With k-token speculative drafts: each row's request slot and k + 1, so the decode
    # attention serves a request's drafted rows from one program, reading its K/V once
    # (kernels/paged_decode_split.py); None / 1 otherwise.
    row_slots: torch.Tensor | None = None
    max_run: int = 1
