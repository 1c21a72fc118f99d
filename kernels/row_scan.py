"""Host-side shape of the sampler kernels' row scans (kernels/sampling_triton.py,
kernels/top_k_top_p_triton.py): logits as fp32 rows, the tile width, and how a row splits
into chunks of tiles, one program each.

Tiles of up to 1024 fp32 logits (4 KiB a load; V = 151,936 is 149 tiles), at least 8
tiles a row for small vocabs. A chunk of tiles is one program, so a small batch still
spreads each row over many SMs.
"""

from __future__ import annotations

import triton
from torch import Tensor

MAX_BLOCK = 1024
# Programs to aim for when splitting rows into chunks: a few waves of H200's 132 SMs.
TARGET_PROGRAMS = 512


def as_fp32_rows(logits: Tensor) -> Tensor:
    """[R, V] float32 with unit stride along V (bf16/fp16 logits are cast, as the spec's
    callers do); a row stride is kept, so a sliced batch is not copied."""
    assert logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}"
    logits = logits.float()
    return logits if logits.stride(1) == 1 else logits.contiguous()


def scan_block(vocab_size: int) -> int:
    """Tile width: up to MAX_BLOCK, and at least 8 tiles a row (128 lanes at least)."""
    return min(MAX_BLOCK, max(128, triton.next_power_of_2(vocab_size) // 8))


def row_chunks(
    num_rows: int, vocab_size: int, target_programs: int = TARGET_PROGRAMS
) -> tuple[int, int, int]:
    """(block, tiles_per_chunk, num_chunks): split rows so R * num_chunks ~ target_programs."""
    block = scan_block(vocab_size)
    num_tiles = triton.cdiv(vocab_size, block)
    num_chunks = min(num_tiles, max(1, target_programs // max(num_rows, 1)))
    tiles_per_chunk = triton.cdiv(num_tiles, num_chunks)
    return block, tiles_per_chunk, triton.cdiv(num_tiles, tiles_per_chunk)
