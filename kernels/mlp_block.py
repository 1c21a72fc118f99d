"""The decode layer's second half in one persistent launch: o projection, gate/up with
SiLU-and-mul, down projection, with grid barriers between them.

The folded decode chain (runner/models/norm_fold.py) runs these as three skinny-linear
launches of 5-7 us each where their weights alone would stream in ~1-3 us; a kernel
boundary costs ~0.5-0.7 us more than a grid barrier (benchmarks/grid_barrier_probe.py).
Here one program per SM (a cooperative launch, so all of them are resident at once) works
through each phase's tiles, then waits at a barrier for every program's results:

    phase 0: r1 = r + attn @ Wo.T           (split-K, last arriver merges; row squares)
    phase 1: act = silu(s * (r1 @ Wg.T)) * (s * (r1 @ Wu.T))   (s: r1's RMSNorm factor)
    phase 2: r2 = r1 + act @ Wd.T           (split-K; row squares for the next layer)

Each tile is `kernels/skinny_linear.skinny_tile`, the body the three separate launches run,
with the same configs, so the result is bitwise the chain's. The barrier is an int64
arrival counter that only grows: a program's ticket says which barrier it is in, so the
counter needs no reset between barriers or launches.

Triton's interpreter runs programs one after another, where a barrier would wait forever:
there (and wherever `phases` asks) each phase is a launch of its own, without barriers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.row_squares import MAX_PARTS, SQ_ROWS, RowSquares, squares_buffer
from pdserve.kernels.skinny_linear import MAX_ROWS, choose_config, skinny_tile
from pdserve.kernels.sm_count import num_sms
from pdserve.kernels.workspace import KernelWorkspace


@dataclass(frozen=True)
class MlpBlockConfig:
    block_n_gate_up: int = 32  # gate/up features a tile (its weight rows: twice that)
    programs_per_sm: int = 1
    num_warps: int = 4
    num_stages: int = 4
    cooperative: bool = True  # a cooperative launch: refused, not hung, if not all fit


@triton.jit
def _grid_barrier(bar_ptr, nprog):
    """Arrive and wait for all `nprog` programs. The counter only grows: ticket t belongs to
    barrier t // nprog, which is passed once the count reaches its end."""
    tl.debug_barrier()  # every thread's stores are issued before the release
    ticket = tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    target = (ticket // nprog + 1) * nprog
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_rows"])
def _mlp_block_kernel(
    attn_ptr, r_ptr, r1_ptr, act_ptr, r2_ptr,
    wo_ptr, bo_ptr, wgu_ptr, bgu_ptr, wd_ptr, bd_ptr,
    part_ptr, count_ptr, sq_ptr, bar_ptr,
    num_rows, hidden, attn_dim, inter, kps_o, kps_gu, kps_d, eps,
    stride_am, stride_rm, stride_r1m, stride_actm, stride_r2m,
    stride_wo, stride_wgu, stride_wd,
    HAS_BIAS_O: tl.constexpr, HAS_BIAS_GU: tl.constexpr, HAS_BIAS_D: tl.constexpr,
    SQ_PARTS_PAD: tl.constexpr, SQ_STRIDE: tl.constexpr,
    SPLIT_O: tl.constexpr, EVEN_O: tl.constexpr, BLOCK_N_O: tl.constexpr,
    SPLIT_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N_D: tl.constexpr,
    EVEN_GU: tl.constexpr, BLOCK_N_GU: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr,
    IEEE_DOT: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tiles_o = tl.cdiv(hidden, BLOCK_N_O)
    if FIRST <= 0:
        for item in range(pid, tiles_o * SPLIT_O, nprog):
            skinny_tile(
                item % tiles_o, item // tiles_o, attn_ptr, wo_ptr, bo_ptr, r1_ptr, part_ptr,
                count_ptr, r_ptr, sq_ptr, sq_ptr, num_rows, hidden, attn_dim, kps_o,
                stride_am, stride_wo, stride_r1m, stride_rm, 1, 1, 0.0, HAS_BIAS_O, False,
                True, False, 1, SQ_STRIDE, SPLIT_O, EVEN_O, M_PAD, BLOCK_N_O, BLOCK_K,
                IEEE_DOT,
            )  # fmt: skip
        if LAST >= 1:
            _grid_barrier(bar_ptr, nprog)
    if FIRST <= 1 and LAST >= 1:
        for item in range(pid, tl.cdiv(inter, BLOCK_N_GU), nprog):
            skinny_tile(
                item, 0, r1_ptr, wgu_ptr, bgu_ptr, act_ptr, part_ptr, count_ptr, r1_ptr,
                sq_ptr, sq_ptr, num_rows, inter, hidden, kps_gu, stride_r1m, stride_wgu,
                stride_actm, 0, tiles_o, hidden, eps, HAS_BIAS_GU, True, False, True,
                SQ_PARTS_PAD, SQ_STRIDE, 1, EVEN_GU, M_PAD, BLOCK_N_GU, BLOCK_K, IEEE_DOT,
            )  # fmt: skip
        if LAST >= 2:
            _grid_barrier(bar_ptr, nprog)
    if LAST >= 2:
        tiles_d = tl.cdiv(hidden, BLOCK_N_D)
        for item in range(pid, tiles_d * SPLIT_D, nprog):
            skinny_tile(
                item % tiles_d, item // tiles_d, act_ptr, wd_ptr, bd_ptr, r2_ptr, part_ptr,
                count_ptr, r1_ptr, sq_ptr, sq_ptr, num_rows, hidden, inter, kps_d,
                stride_actm, stride_wd, stride_r2m, stride_r1m, 1, 1, 0.0, HAS_BIAS_D,
                False, True, False, 1, SQ_STRIDE, SPLIT_D, EVEN_D, M_PAD, BLOCK_N_D,
                BLOCK_K, IEEE_DOT,
            )  # fmt: skip


_BLOCK_K = 128  # choose_config's K step for every skinny tile


def _split(n: int, k: int) -> tuple[int, int, int, bool]:
    """(block_n, k_per_split, splits, even) as skinny_linear's launch works them out."""
    cfg = choose_config(n, k)
    kps = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return cfg.block_n, kps, triton.cdiv(k, kps), k % kps == 0


def mlp_block(
    attn: torch.Tensor,
    r: torch.Tensor,
    o_proj: tuple[torch.Tensor, torch.Tensor | None],
    gate_up_proj: tuple[torch.Tensor, torch.Tensor | None],
    down_proj: tuple[torch.Tensor, torch.Tensor | None],
    eps: float,
    workspace: KernelWorkspace,
    config: MlpBlockConfig | None = None,
    phases: bool | None = None,
) -> tuple[torch.Tensor, RowSquares]:
    """(the residual stream after the layer's MLP, its row sums of squares): the folded
    chain's o / gate-up / down launches (norm_fold.folded_forward) in one. Weights are
    (weight, bias) pairs; gate/up's carries the post-attention norm folded in. `phases`:
    one launch per phase (the default under Triton's interpreter)."""
    cfg = config or MlpBlockConfig()
    num_rows, attn_dim = attn.shape
    wo, bo = o_proj
    wgu, bgu = gate_up_proj
    wd, bd = down_proj
    hidden, inter = wo.shape[0], wgu.shape[0] // 2
    assert 0 < num_rows <= MAX_ROWS, f"the block takes 1..{MAX_ROWS} rows, got {num_rows}"
    assert r.shape == (num_rows, hidden) and wo.shape[1] == attn_dim, "r / attn / o shapes"
    assert wgu.shape == (2 * inter, hidden) and wd.shape == (hidden, inter), "MLP shapes"
    for t in (attn, r, wo, wgu, wd):
        assert t.stride(-1) == 1 and t.dtype == attn.dtype, "unit stride, one dtype"
    block_o, kps_o, split_o, even_o = _split(hidden, attn_dim)
    block_d, kps_d, split_d, even_d = _split(hidden, inter)
    kps_gu = triton.cdiv(hidden, _BLOCK_K) * _BLOCK_K  # gate/up is not split
    assert block_o == block_d, "o and down share the squares layout"
    tiles = triton.cdiv(hidden, block_o)
    assert tiles <= MAX_PARTS, f"{tiles} output tiles exceed the {MAX_PARTS} square parts"
    m_pad = max(16, triton.next_power_of_2(num_rows))
    dev = attn.device
    r1 = torch.empty_like(r)
    r2 = torch.empty_like(r)
    act = torch.empty((num_rows, inter), dtype=attn.dtype, device=dev)
    split = max(split_o, split_d)
    part = workspace.scratch("skinny_linear", split * max(m_pad, MAX_ROWS) * hidden, dev)
    counters = workspace.counters("skinny_linear", tiles, dev)
    bar = workspace.barrier("mlp_block", dev)
    sq = squares_buffer(workspace, dev)
    ieee = attn.dtype == torch.float32 or dev.type == "cpu"
    if phases is None:
        phases = dev.type == "cpu"
    args = (
        attn, r, r1, act, r2, wo, bo if bo is not None else r, wgu,
        bgu if bgu is not None else r, wd, bd if bd is not None else r, part, counters, sq,
        bar, num_rows, hidden, attn_dim, inter, kps_o, kps_gu, kps_d, eps, attn.stride(0),
        r.stride(0), r1.stride(0), act.stride(0), r2.stride(0), wo.stride(0), wgu.stride(0),
        wd.stride(0),
    )  # fmt: skip
    meta = dict(
        HAS_BIAS_O=bo is not None, HAS_BIAS_GU=bgu is not None, HAS_BIAS_D=bd is not None,
        SQ_PARTS_PAD=triton.next_power_of_2(tiles), SQ_STRIDE=SQ_ROWS, SPLIT_O=split_o,
        EVEN_O=even_o, BLOCK_N_O=block_o, SPLIT_D=split_d, EVEN_D=even_d, BLOCK_N_D=block_d,
        EVEN_GU=hidden == kps_gu, BLOCK_N_GU=cfg.block_n_gate_up, BLOCK_K=_BLOCK_K, M_PAD=m_pad, IEEE_DOT=ieee,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if phases:
        for p in range(3):
            _mlp_block_kernel[(num_sms(dev),)](*args, FIRST=p, LAST=p, **meta)
    else:
        grid = (num_sms(dev) * cfg.programs_per_sm,)
        _mlp_block_kernel[grid](
            *args, FIRST=0, LAST=2, launch_cooperative_grid=cfg.cooperative, **meta
        )
    return r2, RowSquares(sq, tiles, hidden)
