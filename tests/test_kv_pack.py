"""Pack/unpack and direct copies of KV units: bit-exact round trips for every layout kind,
descriptor counts of `copy_units`, zero-copy byte frames, and parity of the Triton
kernels (`pack_units_triton`, `unpack_units_triton`) with their torch references.

Without CUDA, conftest sets TRITON_INTERPRET=1 and the kernels run through the
interpreter on CPU tensors, so sizes stay small; with CUDA the storages live on the GPU
and `pack`/`unpack` take the Triton path. Everything is compared on integer views
(`bitwise_view`), so a NaN payload that changes fails the test, and sources are random
bits with explicit NaN (quiet and signalling) patterns.
"""

from __future__ import annotations

import enum
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kernels.kv_pack import (
    bitwise_view,
    pack_units,
    pack_units_ref,
    pack_units_triton,
    unpack_units_ref,
    unpack_units_triton,
)
from pdserve.kvtransfer.layout import (
    GroupStorage,
    KVLayout,
    MambaStateGroup,
    PagedGQAGroup,
    PagedMLAGroup,
)
from pdserve.kvtransfer.pack import (
    UnitCopy,
    as_byte_view,
    check_copies,
    copy_units,
    from_bytes,
    pack,
    unit_runs,
    unpack,
    verify_copies,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_UNITS = 13

# Quiet, signalling and sign-flipped NaNs with payloads: a float copy path quiets sNaNs.
NAN_BITS = {
    torch.float32: [0x7FC00001, 0x7F800001, 0xFFC12345],
    torch.bfloat16: [0x7FC1, 0x7F81, 0xFFFF],
    torch.float16: [0x7E01, 0x7C01, 0xFFFF],
    torch.float8_e4m3fn: [0x7F, 0xFF],
}

GQA = PagedGQAGroup("kv", 3, 4, 2, 5, "bfloat16")
MAMBA = MambaStateGroup("ssm", 3, (6, 3), (2, 4, 5), "bfloat16", "float32")
LAYOUTS = {
    "paged_gqa": KVLayout("m", (GQA,)),
    "paged_mla": KVLayout("m", (PagedMLAGroup("latent", 2, 4, 12, 3, "float16"),)),
    "paged_mla_fp8": KVLayout("m", (PagedMLAGroup("latent", 2, 4, 12, 3, "float8_e4m3fn"),)),
    "mamba_state": KVLayout("m", (MAMBA,)),
    "hybrid": KVLayout(
        "m",
        (
            PagedGQAGroup("attn", 2, 4, 1, 6, "float16"),
            MambaStateGroup("mamba", 2, (5, 3), (3, 7), "float16", "float32"),
        ),
    ),
}
# Unsorted, mostly non-consecutive, the last unit included; blocks vs request slots.
IDS = {
    "paged_gqa": ([9, 2, 12, 3, 4], [0, 11, 5, 6, 1]),
    "paged_mla": ([9, 2, 12, 3, 4], [0, 11, 5, 6, 1]),
    "mamba_state": ([12, 0], [3, 12]),
}


def _ids_for(group, draw: str = "fixed") -> tuple[list[int], list[int]]:
    """IDS, or a seeded random draw of as many distinct ids on each side."""
    src_ids, dst_ids = IDS[group.kind]
    if draw == "fixed":
        return src_ids, dst_ids
    gen = torch.Generator().manual_seed(len(group.name))
    src_perm, dst_perm = (torch.randperm(NUM_UNITS, generator=gen) for _ in range(2))
    return src_perm[: len(src_ids)].tolist(), dst_perm[: len(dst_ids)].tolist()


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _fill_random_bits(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Random words in `t` (in place), every 7th a NaN pattern for float dtypes."""
    gen = torch.Generator().manual_seed(seed)
    bits = bitwise_view(t)
    info = torch.iinfo(bits.dtype)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, generator=gen, dtype=bits.dtype))
    if t.dtype in NAN_BITS:
        width = 8 * t.element_size()
        nans = torch.tensor([_signed(v, width) for v in NAN_BITS[t.dtype]], dtype=bits.dtype)
        flat = bits.view(-1)
        flat[::7] = nans[torch.arange(flat[::7].numel()) % len(nans)]
        if t.dtype != torch.float8_e4m3fn:  # no isnan for float8 on CPU
            assert torch.isnan(t).any()
    return t


def _random_storage(group, num_units: int, seed: int) -> GroupStorage:
    storage = group.allocate(num_units, DEVICE)
    for i, t in enumerate(storage.tensors):
        _fill_random_bits(t, seed + i)
    return storage


def _assert_moved(src: GroupStorage, src_ids, dst: GroupStorage, dst_ids) -> None:
    """dst's units dst_ids hold src's units src_ids bit for bit; every other unit is zero."""
    others = [u for u in range(dst.num_units) if u not in dst_ids]
    for s, d in zip(src.flat(), dst.flat()):
        s_bits, d_bits = bitwise_view(s).cpu(), bitwise_view(d).cpu()
        assert torch.equal(d_bits[:, dst_ids], s_bits[:, src_ids])
        assert torch.equal(d_bits[:, others], torch.zeros_like(d_bits[:, others]))


@pytest.mark.parametrize("draw", ["fixed", "random"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_pack_unpack_round_trip_is_bitwise(name, draw):
    """Guards against a float path that canonicalises NaNs, a unit-major buffer (which
    would round-trip but break layer-wise sending), writes into the wrong units of the
    destination, and a pack that disturbs its source."""
    for seed, group in enumerate(LAYOUTS[name].groups):
        src_ids, dst_ids = _ids_for(group, draw)
        src = _random_storage(group, NUM_UNITS, seed * 10)
        before = [bitwise_view(t).clone() for t in src.tensors]
        buffers = pack(src, src_ids)
        for table, buf in zip(src.flat(), buffers):
            assert buf.shape == (group.num_layers, len(src_ids), table.shape[2])
            assert torch.equal(bitwise_view(buf), bitwise_view(table)[:, src_ids])
        dst = group.allocate(NUM_UNITS, DEVICE)
        unpack(dst, dst_ids, buffers)
        _assert_moved(src, src_ids, dst, dst_ids)
        assert all(torch.equal(b, bitwise_view(t)) for b, t in zip(before, src.tensors))


@pytest.mark.parametrize("draw", ["fixed", "random"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_copy_units_round_trip_and_descriptor_count(name, draw):
    """Guards against off-by-one run boundaries (a unit copied twice or dropped), a copy
    that covers one layer instead of all, and a descriptor count that is not runs x
    tensors. The destination is on the GPU when there is one (a cross-device copy)."""
    for seed, group in enumerate(LAYOUTS[name].groups):
        src_ids, dst_ids = _ids_for(group, draw)
        src = _random_storage(group, NUM_UNITS, seed * 10 + 1)
        src = GroupStorage(group, tuple(t.cpu() for t in src.tensors))
        dst = group.allocate(NUM_UNITS, DEVICE)
        used = copy_units(src, src_ids, dst, dst_ids)
        assert used == len(unit_runs(src_ids, dst_ids)) * len(group.unit_shapes())
        _assert_moved(src, src_ids, dst, dst_ids)


def test_unit_runs_merge_only_when_both_sides_are_consecutive():
    """A merge that looked at one side only, or accepted descending ids, would copy the
    wrong units in one descriptor."""
    assert unit_runs([3, 4, 5, 9], [10, 11, 12, 2]) == [(3, 10, 3), (9, 2, 1)]
    assert unit_runs([1, 2, 3], [5, 7, 8]) == [(1, 5, 1), (2, 7, 2)]
    assert unit_runs([5, 4], [0, 1]) == [(5, 0, 1), (4, 1, 1)]
    assert unit_runs([], []) == []
    with pytest.raises(ValueError, match="3 source ids but 2 destination ids"):
        unit_runs([1, 2, 3], [1, 2])


def _descriptors(runs: int, tensors: int) -> int:
    """What `copy_units` reports: one copy a run and tensor on the CPU; on one CUDA device
    one kernel a tensor, whatever the runs."""
    return tensors if DEVICE == "cuda" else runs * tensors


def test_copy_units_counts_runs_times_tensors():
    """[3,4,5,9] -> [10,11,12,2] is 2 runs: 2 descriptors for a paged group, 4 for a Mamba
    group (conv + ssm); counting per unit would report 4 and 8. On a GPU, one kernel a
    tensor (1 and 2)."""
    for group, tensors in ((GQA, 1), (MAMBA, 2)):
        src = _random_storage(group, NUM_UNITS, 5)
        dst = group.allocate(NUM_UNITS, DEVICE)
        expected = _descriptors(runs=2, tensors=tensors)
        assert copy_units(src, [3, 4, 5, 9], dst, [10, 11, 12, 2]) == expected
        _assert_moved(src, [3, 4, 5, 9], dst, [10, 11, 12, 2])


def test_copy_from_a_window_of_a_larger_cache():
    """A storage over a range of units of a bigger cache has a layer stride larger than
    num_units x E; a copy that assumed dense layers would read the wrong layer."""
    big = _random_storage(GQA, 20, 7).tensors[0]
    window = GroupStorage(GQA, (big[:, 4:17],))
    dst = GQA.allocate(NUM_UNITS, DEVICE)
    assert copy_units(window, [12, 0, 1], dst, [1, 2, 3]) == _descriptors(runs=2, tensors=1)
    _assert_moved(window, [12, 0, 1], dst, [1, 2, 3])
    assert torch.equal(bitwise_view(dst.tensors[0][:, 1]), bitwise_view(big[:, 16]))


def test_edges_refuse_bad_ids_and_buffers():
    """Out-of-range ids would scribble over other requests' blocks (the kernel only masks
    them); duplicate destinations make the result order-dependent; a buffer of the wrong
    shape or dtype would be reinterpreted instead of refused."""
    storage = MAMBA.allocate(4, DEVICE)
    bufs = pack(storage, [1, 2])
    with pytest.raises(ValueError, match=r"unit id 4 is not an int in \[0, 4\)"):
        pack(storage, [4])
    with pytest.raises(ValueError, match="unit id -1"):
        unpack(storage, [-1, 0], bufs)
    with pytest.raises(ValueError, match="must be distinct"):
        unpack(storage, [0, 0], bufs)
    with pytest.raises(ValueError, match=r"has 2 tensor\(s\), got 1 buffer"):
        unpack(storage, [0, 1], bufs[:1])
    with pytest.raises(ValueError, match="buffer 1: shape"):
        unpack(storage, [0, 1], [bufs[0], bufs[1][:, :1]])
    with pytest.raises(ValueError, match="buffer 0: dtype torch.float32"):
        unpack(storage, [0, 1], [bufs[0].float(), bufs[1]])
    with pytest.raises(ValueError, match="must be distinct"):
        copy_units(storage, [0, 1], MAMBA.allocate(4, DEVICE), [2, 2])
    with pytest.raises(ValueError, match="different groups"):
        copy_units(storage, [0], GQA.allocate(4, DEVICE), [0])


def test_id_checks_refuse_every_non_int_and_name_the_first_bad_id():
    """The id checks run as C loops (types, min/max, sort) and fall back to a loop per id
    only to name the culprit. Guards that fast path against what numpy would accept
    silently (True as 1, 2.0 as 2, a numpy integer), against an OverflowError instead of a
    ValueError for an id past int64, and against naming a later bad id than the first."""
    src, dst = _random_storage(GQA, NUM_UNITS, 3), GQA.allocate(NUM_UNITS, DEVICE)
    for bad, shown in (
        ([1, True], "True"),
        ([1, 2.0], "2.0"),
        ([np.int64(1)], repr(np.int64(1))),
        ([2**70], str(2**70)),
        ([3, 13, -1], "13"),
        ([-1, 13], "-1"),
    ):
        with pytest.raises(ValueError, match=rf"source unit id {re.escape(shown)} is not"):
            copy_units(src, bad, dst, list(range(len(bad))))
        with pytest.raises(ValueError, match=rf"destination unit id {re.escape(shown)} is"):
            copy_units(src, list(range(len(bad))), dst, bad)
    with pytest.raises(ValueError, match=r"must be distinct, got \[4, 2, 4\]"):
        copy_units(src, [0, 1, 2], dst, [4, 2, 4])
    with pytest.raises(ValueError, match="3 source ids but 2 destination ids"):
        copy_units(src, [0, 1, 2], dst, [4, 2])
    assert not dst.tensors[0].any(), "a refused copy wrote something"

    class Slot(enum.IntEnum):  # an int subclass other than bool is an int
        A = 2
        B = 7

    # Repeated sources are fine (two destinations may hold one block), as are no ids.
    assert copy_units(src, [Slot.B, 5, 5], dst, [Slot.A, 0, 12]) == _descriptors(3, tensors=1)
    _assert_moved(src, [7, 5, 5], dst, [2, 0, 12])
    assert copy_units(src, [], dst, ()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_byte_frames_are_zero_copy_and_bitwise(dtype):
    """Guards against a frame path that copies (doubling host memory per transfer), that
    fails on bf16/float8 (numpy has neither), or that warns on every read-only frame."""
    t = _fill_random_bits(torch.empty(3, 5, 7, dtype=dtype), 3)
    view = as_byte_view(t)
    assert view.nbytes == t.numel() * t.element_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = from_bytes(bytes(view), (3, 5, 7), dtype)
    assert not caught
    assert back.dtype == dtype and torch.equal(bitwise_view(back), bitwise_view(t))
    bitwise_view(t)[0, 0, 0] += 1  # the view sees later writes: it is the tensor's memory
    assert bytes(view[: t.element_size()]) == bytes(as_byte_view(t[0, 0, :1].clone()))
    shared = bytearray(view)
    over = from_bytes(shared, (3, 5, 7), dtype)
    shared[-1] ^= 0xFF
    assert not torch.equal(bitwise_view(over), bitwise_view(t))
    with pytest.raises(ValueError, match="contiguous"):
        as_byte_view(t.transpose(0, 2))
    with pytest.raises(ValueError, match="needs"):
        from_bytes(bytes(view), (3, 5, 8), dtype)


# (num_layers, num_units, E, dtype, unit_ids, ids dtype): odd E, n = 1, L = 1, the last
# unit, several tiles with a ragged tail (5001 > 2048 float32 per tile), 1- and 8-byte words.
PARITY = [
    (1, 4, 7, torch.float32, [3], torch.int64),
    (3, 9, 1000, torch.bfloat16, [8, 0, 5, 2], torch.int32),
    (3, 6, 7, torch.float16, [5, 3, 0, 1, 4, 2], torch.int64),
    (2, 5, 5001, torch.float32, [4, 1, 2], torch.int32),
    (2, 5, 33, torch.float8_e4m3fn, [4, 0], torch.int64),
    (2, 4, 9, torch.float64, [1, 3], torch.int32),
]


def _parity_ids(case):
    return f"L{case[0]}-NU{case[1]}-E{case[2]}-{str(case[3])[6:]}-n{len(case[4])}"


@pytest.mark.parametrize("case", PARITY, ids=_parity_ids)
def test_pack_kernel_matches_ref(case):
    """Guards against masks that drop a ragged tail tile, int32 offsets, a wrong layer or
    unit stride, and a float load path; `out` starts as garbage so a missed row shows."""
    num_layers, num_units, num_elems, dtype, ids, ids_dtype = case
    src = _fill_random_bits(torch.empty(num_layers, num_units, num_elems, dtype=dtype), 1)
    unit_ids = torch.tensor(ids, dtype=ids_dtype)
    out = _fill_random_bits(torch.empty(num_layers, len(ids), num_elems, dtype=dtype), 2)
    want = out.clone()
    src, unit_ids, out, want = (x.to(DEVICE) for x in (src, unit_ids, out, want))
    pack_units_triton(src, unit_ids, out)
    pack_units_ref(src, unit_ids, want)
    assert torch.equal(bitwise_view(out), bitwise_view(want))


@pytest.mark.parametrize("case", PARITY, ids=_parity_ids)
def test_unpack_kernel_matches_ref(case):
    """Guards against writes into units not listed (the whole table is compared, not
    just the written units) and against the tail/stride bugs of the pack direction."""
    num_layers, num_units, num_elems, dtype, ids, ids_dtype = case
    dst = _fill_random_bits(torch.empty(num_layers, num_units, num_elems, dtype=dtype), 3)
    buf = _fill_random_bits(torch.empty(num_layers, len(ids), num_elems, dtype=dtype), 4)
    unit_ids = torch.tensor(ids, dtype=ids_dtype)
    want = dst.clone()
    dst, want, buf, unit_ids = (x.to(DEVICE) for x in (dst, want, buf, unit_ids))
    unpack_units_triton(dst, unit_ids, buf)
    unpack_units_ref(want, unit_ids, buf)
    assert torch.equal(bitwise_view(dst), bitwise_view(want))


@pytest.mark.parametrize("window", ["units", "layers_and_units"])
def test_kernels_on_strided_views(window):
    """The layer stride is a runtime argument: a table that is a window of a larger cache
    (and a buffer that is a window of a larger one) must be read and written at the
    parent's strides, and nothing outside the window may change."""
    parent = _fill_random_bits(torch.empty(6, 10, 37, dtype=torch.bfloat16, device=DEVICE), 5)
    table = parent[:, 2:8] if window == "units" else parent[::2, 2:8]
    buf_parent = _fill_random_bits(
        torch.empty(table.shape[0], 5, 37, dtype=torch.bfloat16, device=DEVICE), 6
    )
    buf = buf_parent[:, 1:4]
    unit_ids = torch.tensor([5, 0, 3], device=DEVICE)
    want_buf_parent = buf_parent.clone()
    pack_units_triton(table, unit_ids, buf)
    pack_units_ref(table, unit_ids, want_buf_parent[:, 1:4])
    assert torch.equal(bitwise_view(buf_parent), bitwise_view(want_buf_parent))

    want_parent = parent.clone()
    want_table = want_parent[:, 2:8] if window == "units" else want_parent[::2, 2:8]
    buf.copy_(_fill_random_bits(torch.empty_like(buf), 7))
    unpack_units_triton(table, unit_ids, buf)
    unpack_units_ref(want_table, unit_ids, buf)
    assert torch.equal(bitwise_view(parent), bitwise_view(want_parent))


def test_unpack_kernel_drops_out_of_range_ids():
    """A bad id (a bug upstream) must not write before or past the table: the kernel masks
    it instead of scribbling over a neighbouring tensor."""
    parent = _fill_random_bits(torch.empty(2, 6, 9, dtype=torch.float32, device=DEVICE), 8)
    table = parent[:, 1:5]  # units 0 and 5 of the parent sit just outside the table
    buf = _fill_random_bits(torch.empty(2, 3, 9, dtype=torch.float32, device=DEVICE), 9)
    want = parent.clone()
    want[:, 3] = buf[:, 2]
    unpack_units_triton(table, torch.tensor([-1, 4, 2], device=DEVICE), buf)
    assert torch.equal(bitwise_view(parent), bitwise_view(want))


def test_dispatcher_refuses_mismatched_buffers():
    """A bf16 buffer for a float32 table, or a buffer with a strided E axis, would be
    copied as the wrong words; the public entry point asserts instead."""
    table = torch.zeros(2, 4, 8)
    ids = torch.tensor([1])
    with pytest.raises(AssertionError, match="must match table"):
        pack_units(table, ids, torch.empty(2, 1, 8, dtype=torch.bfloat16))
    with pytest.raises(AssertionError, match="E axis must be contiguous"):
        pack_units(table, ids, torch.empty(2, 1, 16)[..., ::2])
    with pytest.raises(AssertionError, match="buffer must be"):
        pack_units(table, ids, torch.empty(2, 2, 8))


_ID = st.one_of(
    st.integers(-3, 12),
    st.just(True),
    st.just(2.0),
    st.just(np.int64(1)),
    st.just(2**70),
    st.builds(enum.IntEnum("Unit", "A B").__getitem__, st.sampled_from(["A", "B"])),
)


def _expected_error(src_ids, dst_ids, num_units: int) -> str | None:
    """The id rules, written out plainly: the message of the first rule broken, or None."""
    if len(src_ids) != len(dst_ids):
        return f"{len(src_ids)} source ids but {len(dst_ids)} destination ids"
    for side, ids, distinct in (("source", src_ids, False), ("destination", dst_ids, True)):
        for uid in ids:
            if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < num_units:
                return f"{side} unit id {uid!r} is not an int in [0, {num_units})"
        if distinct and len(set(ids)) != len(ids):
            return f"{side} unit ids must be distinct"
    return None


@settings(max_examples=400, deadline=None)
@given(src_ids=st.lists(_ID, max_size=6), dst_ids=st.lists(_ID, max_size=6))
def test_id_checks_follow_the_rules(src_ids, dst_ids):
    """Guards the id checks (`verify_copies`, which the graph path runs alone while the
    device copies, and `check_copies`, which also returns the arrays): on any ids, good or
    bad (out of range, negative, bools, floats, numpy ints, ints past int64, int
    subclasses, repeats, mismatched lengths), each must accept exactly what the rules
    accept and name the first rule broken, since the pull's error is the only thing that
    stops a bad copy's units from being used."""
    src, dst = GQA.allocate(10), GQA.allocate(10)
    copies = [UnitCopy(src, src_ids, dst, dst_ids)]
    want = _expected_error(src_ids, dst_ids, 10)
    if want is None:
        verify_copies(copies)
        ((s, d),) = check_copies(copies)
        assert s.dtype == d.dtype == np.int64
        assert s.tolist() == [int(u) for u in src_ids] and d.tolist() == [int(u) for u in dst_ids]
    else:
        for check in (verify_copies, check_copies):
            with pytest.raises(ValueError, match=re.escape(want)):
                check(copies)
