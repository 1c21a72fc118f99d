"""The one-launch unit copy (kernels/kv_copy.py) against its torch reference.

Without CUDA the kernel runs through Triton's interpreter (conftest) on CPU tensors, which
counts one SM, so chunks keep their widest shape unless a case has fewer than four rows.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_copy import (
    copy_units_direct,
    copy_units_ref,
    copy_units_triton,
    launch_shape,
    word_bytes_for,
)
from pdserve.kernels.kv_pack import bitwise_view

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of `dtype` (NaN payloads included for floats), made on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.iinfo(_INT[dtype.itemsize])
    bits = torch.randint(info.min, info.max, shape, generator=gen, dtype=_INT[dtype.itemsize])
    return bits.view(dtype).to(DEVICE)


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
    src = big.to(DEVICE).view(dtype)[1:]  # layer stride 9 * E, offset one layer
    src_ids = torch.tensor([8, 0, 3, 4], dtype=torch.int64, device=DEVICE)
    dst_ids = torch.tensor([1, 6, 2, 9], dtype=torch.int32, device=DEVICE)
    want = torch.zeros(L, 10, E, dtype=dtype, device=DEVICE)
    got = torch.zeros(L, 10, E, dtype=dtype, device=DEVICE)
    copy_units_ref(src, src_ids, want, dst_ids)
    copy_units_triton(src, src_ids, got, dst_ids)
    assert torch.equal(bitwise_view(got), bitwise_view(want))
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
        assert torch.equal(bitwise_view(got[:, d]), bitwise_view(src[:, s]))
    untouched = [u for u in range(10) if u not in dst_ids.tolist()]
    assert not bitwise_view(got[:, untouched]).any()


# (L, NU_src, NU_dst, E, dtype, src_ids, dst_ids): element sizes 1/2/4/8; rows of 33 B (no
# wide word fits), 14 B (int16), 20,004 B (int32 words, 3 tiles and a ragged tail), 65,536 B
# (a bf16 Qwen3 block-layer: 4 tiles of int64, one program or, with one row, four), 16,400 B
# (2,050 int64 words: a second chunk of 2 live words), 72,000 B (9,000 words: a 4-tile chunk
# then one of 808 words), 40 layers, n = 1, ids out of order on
# both sides, the last unit of each table.
PARITY = [
    (2, 5, 6, 33, torch.float8_e4m3fn, [4, 0, 2], [5, 1, 3]),
    (3, 4, 4, 7, torch.bfloat16, [3, 1], [0, 3]),
    (2, 5, 4, 5001, torch.float32, [4, 1, 2], [2, 0, 3]),
    (2, 3, 5, 32768, torch.bfloat16, [2, 0], [1, 4]),
    (1, 2, 3, 32768, torch.bfloat16, [1], [2]),
    (40, 6, 7, 12, torch.float16, [5, 3, 0, 1, 4], [6, 0, 2, 5, 1]),
    (2, 4, 4, 9, torch.float64, [1, 3], [3, 0]),
    (1, 3, 3, 8200, torch.bfloat16, [2, 1, 0], [0, 2, 1]),
    (2, 3, 3, 36000, torch.bfloat16, [2, 0], [1, 2]),
]


def _case_id(case) -> str:
    return f"L{case[0]}-E{case[3]}-{str(case[4]).removeprefix('torch.')}-n{len(case[5])}"


@pytest.mark.parametrize("case", PARITY, ids=_case_id)
def test_kernel_matches_reference_on_awkward_shapes(case):
    """Guards the word-wide copy: a row whose bytes are not a multiple of the chosen word
    (a tail dropped or overrun), a chunk loop that skips or repeats a tile, a program id
    split into (unit, layer, chunk) the wrong way round, and writes outside the listed
    destination units (the whole table, which starts as random bits, is compared)."""
    num_layers, nu_src, nu_dst, num_elems, dtype, src_list, dst_list = case
    src = _random((num_layers, nu_src, num_elems), dtype, 1)
    got = _random((num_layers, nu_dst, num_elems), dtype, 2)
    want = got.clone()
    src_ids = torch.tensor(src_list, device=DEVICE)
    dst_ids = torch.tensor(dst_list, dtype=torch.int32, device=DEVICE)
    copy_units_triton(src, src_ids, got, dst_ids)
    copy_units_ref(src, src_ids, want, dst_ids)
    assert torch.equal(bitwise_view(got), bitwise_view(want))


@pytest.mark.parametrize("offset_elems", [0, 1, 2])
def test_kernel_on_windows_that_narrow_the_word(offset_elems):
    """A table that is a window of a bigger cache may start at an address (and have a
    layer stride) that only a narrower word tiles: the copy must pick that word and still
    read every layer at the parent's stride, and leave the parent outside untouched."""
    parent = _random((4, 7, 36), torch.bfloat16, 3).view(-1)
    # [3, 6, 36] windows of the flat parent, layer stride 7 * 36 + 4 elements (8 B), shifted.
    layer_stride = 7 * 36 + 4
    src = parent[offset_elems:].as_strided((3, 6, 36), (layer_stride, 36, 1))
    dst_parent = _random((4, 7, 36), torch.bfloat16, 4).view(-1)
    dst = dst_parent[offset_elems:].as_strided((3, 6, 36), (layer_stride, 36, 1))
    want_parent = dst_parent.clone()
    want = want_parent[offset_elems:].as_strided((3, 6, 36), (layer_stride, 36, 1))
    src_ids = torch.tensor([5, 0, 3], device=DEVICE)
    dst_ids = torch.tensor([1, 4, 5], device=DEVICE)
    assert word_bytes_for(src, dst) == {0: 8, 1: 2, 2: 4}[offset_elems]
    copy_units_triton(src, src_ids, dst, dst_ids)
    copy_units_ref(src, src_ids, want, dst_ids)
    assert torch.equal(bitwise_view(dst_parent), bitwise_view(want_parent))


def test_word_is_the_widest_that_tiles_both_sides():
    """The word decides the vector width: int64 for a dense bf16 block; narrower as soon
    as one side's row, stride or base address is not a multiple (a wider word would read
    across a row boundary)."""
    block = torch.zeros(2, 4, 32768, dtype=torch.bfloat16)
    assert word_bytes_for(block, block) == 8
    odd_row = torch.zeros(2, 4, 6, dtype=torch.bfloat16)  # 12 B rows
    assert word_bytes_for(odd_row, odd_row) == 4
    assert word_bytes_for(block, torch.zeros(3, 5, 32768, dtype=torch.bfloat16)[1:]) == 8
    shifted = torch.zeros(2 * 4 * 32768 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 32768)
    assert word_bytes_for(block, shifted) == 2
    fp8 = torch.zeros(2, 3, 33, dtype=torch.float8_e4m3fn)
    assert word_bytes_for(fp8, fp8) == 1
    f64 = torch.zeros(2, 3, 5, dtype=torch.float64)
    assert word_bytes_for(f64, f64) == 8


def test_launch_shape_fills_the_gpu_then_grows_programs():
    """The 2,048-token Qwen3 request (128 blocks x 28 layers of 8,192 int64 words) gets
    64 KB programs (one per block-layer); the 128-token one (8 blocks) would then leave
    most of 132 SMs idle, so its programs shrink to one 16 KB tile. Chunks are whole tiles."""
    assert launch_shape(128 * 28, 8192, 132) == (2048, 8192)
    assert launch_shape(8 * 28, 8192, 132) == (2048, 2048)
    assert launch_shape(8 * 28, 8192, 1) == (2048, 8192)
    assert launch_shape(8, 5001, 1) == (2048, 6144)  # 3 tiles: chunks need not be 2^k
    assert launch_shape(1, 5001, 1) == (2048, 2048)
    assert launch_shape(40 * 5, 3, 132) == (4, 4)


def test_empty_copy_launches_nothing():
    """No ids (a pull whose units are all local already) must be a no-op, not a grid of
    zero programs (CUDA refuses it)."""
    src = _random((2, 3, 8), torch.float32, 5)
    dst = torch.zeros(2, 3, 8, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_units_triton(src, empty, dst, empty)
    copy_units_direct(src, empty, dst, empty)
    assert not dst.any()


def test_joined_ids_at_an_offset_and_one_pair_reused():
    """Guards the pull path's id buffer (kvtransfer/pack.copy_groups): one int64 buffer
    holds every group's source ids then destination ids, each group at its own offset,
    and the launch set-up is reused per pair of tables. Ids outside a group's span (here
    -1, out of range) must never be read, and a second copy through the cached pair with
    another id count must land as well."""
    from pdserve.kernels.kv_copy import PairCache, copy_units_joined

    src = _random((3, 9, 40), torch.bfloat16, 11)
    dst = torch.zeros(3, 7, 40, dtype=torch.bfloat16, device=DEVICE)
    pairs = PairCache()
    ids = torch.tensor([-1, -1, 8, 0, 5, 6, 2, 4, -1], dtype=torch.int64, device=DEVICE)
    copy_units_joined(pairs.get(src, dst), ids, 2, 3, peer=False)  # 8,0,5 -> 6,2,4
    ids2 = torch.tensor([7, 3, -1], dtype=torch.int64, device=DEVICE)
    copy_units_joined(pairs.get(src, dst), ids2, 0, 1, peer=False)  # 7 -> 3
    assert pairs.get(src, dst) is pairs.get(src, dst)
    want = torch.zeros_like(dst)
    for s, d in ((8, 6), (0, 2), (5, 4), (7, 3)):
        want[:, d] = src[:, s]
    assert torch.equal(bitwise_view(dst), bitwise_view(want))


# On a GPU, 16 B-aligned rows take the CUDA C kernel (kernels/kv_copy_cuda.py): bf16 x 32,768
# (one 64 KB row, one block), bf16 x 40,000 (80,000 B: a 16 KB chunk grid whose last chunk
# is partial) and fp32 x 8,196 (three chunks, the last one vector); the others Triton.
_COUNTED_SHAPES = [
    (torch.bfloat16, 3, 32768),
    (torch.bfloat16, 2, 40000),
    (torch.float32, 1, 8196),
    (torch.float32, 2, 5001),
    (torch.float16, 4, 7),
]


@pytest.mark.parametrize("dtype, L, E", _COUNTED_SHAPES)
@pytest.mark.parametrize("count", [0, 1, 4])
def test_counted_copy_reads_its_count_on_the_device_and_skips_bad_ids(dtype, L, E, count):
    """Guards the graph path (kvtransfer/copy_graph.py): one captured launch serves every
    count up to its capacity, so the kernel must read the count from the buffer, copy
    exactly that many pairs (slots past it hold valid-looking ids that must not be
    copied), and skip a pair with an id outside its table (the host checks ids only while
    the copy runs), writing nothing else."""
    from pdserve.kernels.kv_copy import copy_units_counted, copy_units_counted_ref

    capacity = 6
    src = _random((L, 9, E), dtype, 21)
    got = _random((L, 8, E), dtype, 22)
    want = got.clone()
    src_slots = [8, 99, 3, 0, 5, 6]  # 99: past the source table
    dst_slots = [1, 4, -1, 6, 7, 2]  # -1: before the destination table
    ids = torch.tensor([count, *src_slots, *dst_slots], dtype=torch.int64, device=DEVICE)
    padded = torch.cat([torch.tensor([7, 7], dtype=torch.int64, device=DEVICE), ids])
    copy_units_counted(src, got, padded, 2, capacity)
    copy_units_counted_ref(src, want, padded, 2, capacity)
    assert torch.equal(bitwise_view(got), bitwise_view(want))
    before = _random((L, 8, E), dtype, 22)  # the destination as it started
    landed = {1: 8, 6: 0} if count == 4 else {1: 8} if count == 1 else {}
    for d in range(8):
        expect = src[:, landed[d]] if d in landed else before[:, d]
        assert torch.equal(bitwise_view(got[:, d]), bitwise_view(expect)), d


@pytest.mark.parametrize("dtype, L, E", _COUNTED_SHAPES)
def test_counted_copy_takes_the_cuda_kernel_exactly_where_it_applies(dtype, L, E):
    """Guards the choice of kernels/kv_copy_cuda.py: on a GPU, tables whose rows and
    strides are multiples of 16 B take it (the counted test above then checks its bits);
    the rest, and every CPU table, take the Triton kernel."""
    from pdserve.kernels import kv_copy_cuda
    from pdserve.kernels.kv_copy import PairCache

    src, dst = _random((L, 9, E), dtype, 21), _random((L, 8, E), dtype, 22)
    pair = PairCache().get(src, dst)
    ids = torch.zeros(1 + 2 * 4, dtype=torch.int64, device=DEVICE)  # count 0: no copy
    pair.launch_counted(ids, 0, 4)
    aligned = (E * dtype.itemsize) % 16 == 0
    assert kv_copy_cuda.eligible(src, dst) == (DEVICE == "cuda" and aligned)
    assert pair._cuda_counted == (DEVICE == "cuda" and aligned)


def test_cuda_copy_chunks_shrink_only_when_the_grid_would_be_thin():
    """The CUDA copy's block share: 64 KB of a row while that gives >= 4 blocks an SM,
    else 16 KB; never more than the row."""
    from pdserve.kernels.kv_copy_cuda import chunk_vecs

    assert chunk_vecs(rows=3584, row_vecs=4096, num_sms=132) == 4096  # 2,048-token pull
    assert chunk_vecs(rows=224, row_vecs=4096, num_sms=132) == 1024  # 128-token pull
    assert chunk_vecs(rows=10_000, row_vecs=10_000, num_sms=132) == 4096
    assert chunk_vecs(rows=1, row_vecs=3, num_sms=132) == 3


@pytest.mark.parametrize("n", [1, 257, 1024, 1025, 3001])
def test_stage_ids_copies_the_pinned_buffer_whole(n):
    """Guards the copy graph's id upload (kvtransfer/copy_graph.py): the staging kernel
    reads the pinned host buffer (on a GPU through unified addressing) and must land every
    int64 slot bit for bit, full 64-bit range, across program boundaries (1,024 ids a
    program), with nothing written past the buffer."""
    from pdserve.kernels.kv_copy import stage_ids

    gen = torch.Generator().manual_seed(n)
    host = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    if DEVICE == "cuda":
        host = host.pin_memory()
    backing = torch.full((n + 5,), -7, dtype=torch.int64, device=DEVICE)
    stage_ids(host, backing[:n])
    assert torch.equal(backing[:n].cpu(), host.cpu())
    assert (backing[n:] == -7).all()
