"""The CUDA MLP block's host side, on any machine: the tiles `choose_config` picks and the
spec `mlp_block_ref` (the kernel itself runs in test_gpu_mlp_block.py on a Hopper GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.mlp_block_cuda import MAX_SMEM, choose_config, mlp_block_ref
from pdserve.kernels.row_squares import MAX_PARTS


@pytest.mark.parametrize(
    "shape", [(1024, 2048, 3072), (576, 576, 1536), (64, 64, 128), (128, 256, 384)]
)
@pytest.mark.parametrize("num_sms", [132, 114, 78])
def test_config_tiles_fit(shape, num_sms):
    """Guards co-residency (a program per SM at most, within shared memory: the programs
    wait for each other, so one that cannot start deadlocks the launch) and the kernel's
    tiling rules (16-multiple K slices, whole tiles, squares parts within the buffer).
    With fewer SMs a wide MLP may not tile (Qwen3's gate/up at 114: 32-feature tiles are
    too big for shared memory); on the H200's 132 every shape here does."""
    hidden, attn_width, inter = shape
    cfg = choose_config(hidden, attn_width, inter, torch.bfloat16, num_sms)
    if num_sms == 132:
        assert cfg is not None
    if cfg is None:
        return
    assert cfg.grid <= num_sms and cfg.smem_bytes <= MAX_SMEM
    assert cfg.sq_parts <= MAX_PARTS
    for k, splits in ((attn_width, cfg.o_splits), (hidden, cfg.gu_splits), (inter, cfg.d_splits)):
        assert k % splits == 0 and (k // splits) % 16 == 0
    assert inter % cfg.gu_features == 0 and 2 * cfg.gu_features <= 128
    assert cfg.gu_features % 8 == 0


def test_config_declines_what_the_kernel_cannot_tile():
    """float32, a hidden size off the 64-feature tiles, and K widths that no 16-multiple
    slice divides go to the Triton chain."""
    assert choose_config(1024, 2048, 3072, torch.float32, 132) is None
    assert choose_config(1000, 2048, 3072, torch.bfloat16, 132) is None
    assert choose_config(1024, 2040, 3072, torch.bfloat16, 132) is None


def test_qwen3_tiles():
    """The tiles the benchmark shape runs (docs: 128 programs; gate/up unsplit)."""
    cfg = choose_config(1024, 2048, 3072, torch.bfloat16, 132)
    assert (cfg.o_splits, cfg.gu_features, cfg.gu_splits, cfg.d_splits) == (8, 24, 1, 8)
    assert cfg.grid == 128 and cfg.sq_parts == 128
    assert cfg.cluster and cfg.gu_multicast  # 16 clusters of the 8 splits of a tile


def test_ref_is_the_folded_layer():
    """The spec against the unfused fp32 math of a decoder layer's second half with the
    post-attention norm weight folded into gate/up: tolerance of bf16's rounding of the
    intermediate streams (2^-7 relative, a few of them)."""
    torch.manual_seed(0)
    rows, hidden, attn_width, inter = 5, 64, 96, 160
    a = torch.randn(rows, attn_width).bfloat16()
    r = torch.randn(rows, hidden).bfloat16()
    w_o = (torch.randn(hidden, attn_width) / attn_width**0.5).bfloat16()
    w_gu = (torch.randn(2 * inter, hidden) / hidden**0.5).bfloat16()
    w_d = (torch.randn(hidden, inter) / inter**0.5).bfloat16()
    got, sq = mlp_block_ref(a, r, w_o, w_gu, w_d, 1e-6)
    r1 = r.float() + a.float() @ w_o.float().T
    x = r1 * torch.rsqrt(r1.pow(2).mean(-1, keepdim=True) + 1e-6)
    gate, up = (x @ w_gu.float().T).chunk(2, -1)
    r2 = r1 + (F.silu(gate) * up) @ w_d.float().T
    torch.testing.assert_close(got.float(), r2, rtol=2**-5, atol=2**-5)
    torch.testing.assert_close(sq, (got.float() ** 2).sum(-1), rtol=1e-5, atol=1e-5)
