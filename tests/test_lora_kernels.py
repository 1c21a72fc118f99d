"""kernels/lora.py: the Triton shrink/expand pair equals the per-slot torch reference for
tokens of mixed adapters (slot 0: none), on awkward sizes under the interpreter and the
runner's sizes on CUDA; a base-model token's row is left bit-for-bit as it was."""

from __future__ import annotations

import pytest
import torch
from test_triton_index_kernels import DEVICE, ON_CUDA

from pdserve.kernels.lora import add_lora_ref, add_lora_triton

# (tokens, K inputs, R rank columns, N outputs, slots incl. 0)
SMALL = [(1, 77, 12, 50, 2), (7, 130, 4, 33, 3), (33, 64, 48, 96, 5), (3, 40, 200, 20, 2)]
REAL = [
    (1, 1024, 48, 4096, 2),
    (32, 1024, 48, 4096, 5),
    (300, 3072, 16, 1024, 3),
    (32, 4096, 192, 4096, 3),
]  # rank blocks: 3 x rank 64
SHAPES = REAL if ON_CUDA else SMALL
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _case(t, k, r, n, slots, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(slots, r, k, generator=g) * k**-0.5
    b = torch.randn(slots, n, r, generator=g) * r**-0.5
    a[0], b[0] = 0, 0  # slot 0: the base model
    y = torch.randn(t, n, generator=g).to(dtype)
    ids = torch.randint(0, slots, (t + 3,), generator=g, dtype=torch.int32)  # + stale tail
    ids[0] = slots - 1 if t > 1 else ids[0]
    to = dict(device=DEVICE)
    return (y.to(**to), x.to(**to), a.to(dtype).to(**to), b.to(dtype).to(**to), ids.to(**to))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_reference(shape, dtype):
    y, x, a, b, ids = _case(*shape, dtype)
    # The reference in float32 from the same (rounded) inputs: the kernel keeps the delta
    # in float32 and rounds once, the dtype reference rounds twice more.
    want = add_lora_ref(y.float().clone(), x.float(), a.float(), b.float(), ids).to(dtype)
    got = add_lora_triton(y.clone(), x, a, b, ids)
    # float32: reduction order only (~1e-6 relative of |delta| ~ 1); 16 bits: the one
    # final rounding, 1 ulp of |y + delta| <= ~8 (float16 2^-10 * 8, bf16 2^-7 * 8)
    atol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 7e-2}[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    base = ids[: x.shape[0]] == 0
    assert torch.equal(got[base], y[base])  # untouched, not re-rounded
    if (~base).any():  # the adapters' rows did move
        assert not torch.equal(got[~base], y[~base])


def test_slot_of_each_token_is_its_own():
    """A kernel that used one token's slot for all would pass a one-adapter batch."""
    y, x, a, b, ids = _case(6, 40, 8, 24, 4, torch.float32, seed=3)
    ids[:6] = torch.tensor([1, 2, 3, 0, 2, 1], dtype=torch.int32)
    got = add_lora_triton(y.clone(), x, a, b, ids)
    for t, s in enumerate(ids[:6].tolist()):
        want = y[t] + (b[s] @ (a[s] @ x[t]))
        torch.testing.assert_close(got[t], want, atol=1e-4, rtol=0)
