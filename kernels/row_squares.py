"""Row sums of squares of the residual stream: what an RMSNorm needs from its input when
the norm itself is folded away (runner/models/norm_fold.py).

With the norm weights folded into the next linear's columns, `rms_norm(r) @ W.T` becomes
`s * (r @ W'.T)` with `s = rsqrt(mean(r^2) + eps)` per row: the linear reads the residual
stream `r` as it is and scales its output rows. `s` needs each row's sum of squares. The
kernel that writes `r` (the o / down projection adding its residual, or this module's
kernel for the embedding) writes those sums in `parts` partial sums, one per output tile,
and the consumers (the q/k/v preparation, the gate/up projection) add the parts up. That
keeps the producer in one launch (no cross-tile reduction) and the consumer's sum in a
fixed order (the same result whichever tile finished last).

Layout: part p of row m at `buf[p * SQ_ROWS + m]`, fp32; rows are a decode batch
(at most SQ_ROWS, the skinny linear's row limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.workspace import KernelWorkspace

SQ_ROWS = 64  # rows a squares buffer holds: kernels/skinny_linear.py's MAX_ROWS
MAX_PARTS = 64  # partial sums per row a buffer holds (output tiles of the producer)


@dataclass(frozen=True)
class RowSquares:
    """Sums of squares of the rows of a [rows, dim] tensor, in `parts` partial sums."""

    buf: torch.Tensor  # [>= parts * SQ_ROWS] float32
    parts: int
    dim: int

    @property
    def parts_pad(self) -> int:
        """The consumers load all parts as one power-of-two tile."""
        return triton.next_power_of_2(self.parts)


@dataclass(frozen=True)
class ScaleRows:
    """Scale row m by `rsqrt(squares of row m / dim + eps)`: an RMSNorm's factor."""

    squares: RowSquares
    eps: float


def squares_buffer(workspace: KernelWorkspace, device: torch.device) -> torch.Tensor:
    """The model's one squares buffer: each producer overwrites it after the previous
    consumer ran (one stream), so a decode step needs no more than one."""
    return workspace.scratch("row_squares", MAX_PARTS * SQ_ROWS, device)


def row_scale_ref(scale: ScaleRows, num_rows: int) -> torch.Tensor:
    """[num_rows] float32 `rsqrt(mean square + eps)`: the RMSNorm's per-row factor."""
    sq = scale.squares
    parts = sq.buf[: sq.parts * SQ_ROWS].view(sq.parts, SQ_ROWS)[:, :num_rows]
    return torch.rsqrt(parts.sum(0) / sq.dim + scale.eps)


def row_squares_ref(x: torch.Tensor) -> torch.Tensor:
    """[rows] float32 sums of squares of x's rows (as the norm computes them: in fp32)."""
    xf = x.to(torch.float32)
    return (xf * xf).sum(-1)


@triton.jit
def row_scale(sq_ptr, offs_m, m_mask, num_parts, dim, eps, PARTS_PAD: tl.constexpr,
              SQ_STRIDE: tl.constexpr):  # fmt: skip
    """[len(offs_m)] rsqrt(sum of the parts / dim + eps): the consumers' half."""
    parts = tl.arange(0, PARTS_PAD)
    mask = (parts < num_parts)[:, None] & m_mask[None, :]
    sq = tl.load(sq_ptr + parts[:, None] * SQ_STRIDE + offs_m[None, :], mask=mask, other=0.0)
    return tl.rsqrt(tl.sum(sq, 0) / dim + eps)


@triton.jit
def _row_squares_kernel(x_ptr, sq_ptr, dim, stride_x, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < dim, other=0.0)
    xf = x.to(tl.float32)
    tl.store(sq_ptr + row, tl.sum(xf * xf, 0))


def row_squares_triton(x: torch.Tensor, buf: torch.Tensor) -> RowSquares:
    """Writes x's row sums of squares into `buf` as one part (the embedding's rows)."""
    num_rows, dim = x.shape
    assert 0 < num_rows <= SQ_ROWS, f"squares are kept for 1..{SQ_ROWS} rows, got {num_rows}"
    assert x.stride(1) == 1 and buf.dtype == torch.float32 and buf.numel() >= SQ_ROWS
    block_d = triton.next_power_of_2(dim)
    _row_squares_kernel[(num_rows,)](
        x, buf, dim, x.stride(0), BLOCK_D=block_d, num_warps=4 if block_d <= 4096 else 8
    )
    return RowSquares(buf, 1, dim)
