"""The one-launch unit copy (kernels/kv_copy.py) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_copy import copy_units_ref, copy_units_triton
from pdserve.kernels.kv_pack import bitwise_view


@pytest.mark.parametrize(
    "dtype, L, E", [(torch.bfloat16, 3, 7), (torch.float32, 2, 1000), (torch.float16, 1, 5001)]
)
def test_copy_units_kernel_matches_reference_bitwise(dtype, L, E):
    """Guards the direct cuda_ipc/local path: scattered source units land at scattered
    destination units bit for bit (NaN payloads included), nothing else is written, and
    a strided layer view (a window of a bigger cache) is honoured."""
    gen = torch.Generator().manual_seed(E)
    big = torch.randint(-(2**15), 2**15, (L + 1, 9, E), generator=gen, dtype=torch.int16)
    if dtype == torch.float32:
        big = torch.randint(-(2**31), 2**31 - 1, (L + 1, 9, E), generator=gen, dtype=torch.int32)
    src = big.view(dtype)[1:]  # layer stride 9 * E, offset one layer
    src_ids = torch.tensor([8, 0, 3, 4], dtype=torch.int64)
    dst_ids = torch.tensor([1, 6, 2, 9], dtype=torch.int32)
    want = torch.zeros(L, 10, E, dtype=dtype)
    got = torch.zeros(L, 10, E, dtype=dtype)
    copy_units_ref(src, src_ids, want, dst_ids)
    copy_units_triton(src, src_ids, got, dst_ids)
    assert torch.equal(bitwise_view(got), bitwise_view(want))
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
        assert torch.equal(bitwise_view(got[:, d]), bitwise_view(src[:, s]))
    untouched = [u for u in range(10) if u not in dst_ids.tolist()]
    assert not bitwise_view(got[:, untouched]).any()
