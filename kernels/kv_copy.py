"""Copy KV units between two paged storages in one launch: dst[:, d_i] = src[:, s_i].

The direct transfer path (local and cuda_ipc transports) with no staging buffer: a
request's blocks are usually scattered on both sides, so a copy per run of consecutive
blocks costs one launch per run: on the H200 a scattered 2,048-token Qwen3-0.6B-shaped
request took 2.97 ms per cuda_ipc pull that way, 0.41 ms with the first version of this
kernel, against 0.13 ms for one contiguous copy of the same bytes (benchmarks/transfer.py).
Source and destination may be different allocations on one device (a CUDA IPC mapping of
another process's cache included).

A (unit, layer) row is E elements, dense. Rows are copied as the widest integer word that
tiles them on both sides (a bf16 paged_gqa row of 65,536 B is 8,192 int64 words), so the
copy is bitwise for any dtype and a thread moves 16 B vectors whatever the element size.
The grid is flat: one program per chunk of a row, a chunk being 1 to 4 tiles of
_TILE_WORDS, fewer tiles when the request is too small to fill the GPU.

The unit ids reach the kernel as one int64 buffer, source ids then destination ids at an
offset, so a pull uploads one buffer for all its groups and makes no views of it; what a
launch between two tables needs besides (word views, strides, launch shapes) is worked
out once per pair of tables (`PairCache`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import kv_copy_cuda
from pdserve.kernels.kv_pack import bitwise_view, rows_tile_by
from pdserve.kernels.sm_count import num_sms

# Words one load moves: with 4 warps, 16 words a thread, i.e. eight independent 16 B
# vectors in flight when words are int64 (a 16 KB tile). Narrower words (odd row sizes)
# keep 16 words a thread, so an unaligned fp8 row does not spill 128 pointers a thread.
_TILE_WORDS = 2048
_NUM_WARPS = 4
# A program copies up to 4 tiles (64 KB of int64 words: one bf16 Qwen3 block-layer), which
# makes a 2,048-token request 3,584 programs instead of 28,672 of 8 KB; each reads its
# unit ids once. Below 4 programs per SM, chunks shrink to one tile so a small request
# (8 blocks x 28 layers) still spreads over every SM.
_MAX_TILES_PER_PROGRAM = 4
_MIN_PROGRAMS_PER_SM = 4
_MAX_GRID_X = 2**31 - 1


def copy_units_ref(
    src: torch.Tensor,  # [L, NU_src, E]
    src_ids: torch.Tensor,  # [n] int32/int64
    dst: torch.Tensor,  # [L, NU_dst, E], units dst_ids written in place
    dst_ids: torch.Tensor,  # [n] int32/int64, distinct
) -> None:
    rows = bitwise_view(src).index_select(1, src_ids.long())
    bitwise_view(dst).index_copy_(1, dst_ids.long(), rows)


@triton.jit
def _copy_chunk(
    src, dst, start, num_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr
):
    """Words [start, start + CHUNK) of one row, BLOCK at a time (masked past num_words
    unless EVEN). No cache hints: evict_first on both sides measured 0.131 ms for the
    2,048-token request against 0.126 ms without (benchmarks/kv_copy_sweep.py, H200)."""
    for k in tl.static_range(0, CHUNK, BLOCK):
        offs = start + k + tl.arange(0, BLOCK)
        if EVEN:
            tl.store(dst + offs, tl.load(src + offs))
        else:
            mask = offs < num_words
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


# Per-request counts are not specialised on (no compile variant per value class mid-serving).
@triton.jit(do_not_specialize=["ids_offset", "n", "chunks_per_row"])
def _copy_units_kernel(
    src_ptr,  # [L, NU_src, W] words
    dst_ptr,  # [L, NU_dst, W] words
    ids_ptr,  # int64: n source ids at ids_offset, then n destination ids
    ids_offset,
    n,
    src_layer_stride,
    src_unit_stride,
    dst_layer_stride,
    dst_unit_stride,
    num_layers,
    num_words,  # W
    chunks_per_row,
    CHUNK: tl.constexpr,  # words per program, a multiple of BLOCK
    BLOCK: tl.constexpr,  # words per load
    EVEN: tl.constexpr,  # W is a multiple of CHUNK: no masks
):
    pid = tl.program_id(0)  # (unit index, layer, chunk), chunk fastest
    row = pid // chunks_per_row
    chunk = pid - row * chunks_per_row
    i = row // num_layers
    layer = (row - i * num_layers).to(tl.int64)
    s = tl.load(ids_ptr + ids_offset + i)
    d = tl.load(ids_ptr + ids_offset + n + i)
    src = src_ptr + layer * src_layer_stride + s * src_unit_stride
    dst = dst_ptr + layer * dst_layer_stride + d * dst_unit_stride
    _copy_chunk(src, dst, chunk.to(tl.int64) * CHUNK, num_words, CHUNK, BLOCK, EVEN)


@triton.jit(do_not_specialize=["count_offset", "src_offset", "dst_offset", "chunks_per_row"])
def _copy_units_counted_kernel(
    src_ptr,  # [L, NU_src, W] words
    dst_ptr,  # [L, NU_dst, W] words
    ids_ptr,  # int64: the id count n at count_offset, n source ids at src_offset, n
    # destination ids at dst_offset
    count_offset,
    src_offset,
    dst_offset,
    src_units,  # NU_src: a source id outside [0, NU_src) is skipped, not read
    dst_units,  # NU_dst: likewise for destination ids
    src_layer_stride,
    src_unit_stride,
    dst_layer_stride,
    dst_unit_stride,
    num_layers,
    num_words,  # W
    chunks_per_row,
    CHUNK: tl.constexpr,  # words per program, a multiple of BLOCK
    BLOCK: tl.constexpr,  # words per load
    EVEN: tl.constexpr,  # W is a multiple of CHUNK: no masks
):
    """`_copy_units_kernel` over a grid sized for a capacity of ids, the count read on the
    device: programs of slots past it return at once. One launch shape serves every count
    up to the capacity, so it is captured in a CUDA graph once and replayed for any pull
    whose ids fit (kvtransfer/copy_graph.py). The ids are checked here (out of range:
    skipped) because the graph path checks them on the host while the copy runs."""
    pid = tl.program_id(0)  # (unit slot, layer, chunk), chunk fastest
    row = pid // chunks_per_row
    chunk = pid - row * chunks_per_row
    i = row // num_layers
    # The count and this slot's ids in one round trip: a slot past the count holds a stale
    # (or zero) id pair, loaded in bounds and then not used.
    n = tl.load(ids_ptr + count_offset)
    s = tl.load(ids_ptr + src_offset + i)
    d = tl.load(ids_ptr + dst_offset + i)
    if i < n:
        layer = (row - i * num_layers).to(tl.int64)
        if (s >= 0) & (s < src_units) & (d >= 0) & (d < dst_units):
            src = src_ptr + layer * src_layer_stride + s * src_unit_stride
            dst = dst_ptr + layer * dst_layer_stride + d * dst_unit_stride
            _copy_chunk(src, dst, chunk.to(tl.int64) * CHUNK, num_words, CHUNK, BLOCK, EVEN)


# Ids one staging program moves: a 2,048-token Qwen3 pull's 257 slots take one program.
_STAGE_BLOCK = 1024


# One compiled variant for every length (no specialisation of `n`, one BLOCK): each copy
# graph capacity (8 to 8,192 ids) would otherwise compile its own on first use, and on a
# fresh machine a compile took a first pull ~0.6 s (H200, benchmarks/gpu_serve_log.sh).
@triton.jit(do_not_specialize=["n"])
def _stage_ids_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def stage_ids(host: torch.Tensor, device: torch.Tensor) -> None:
    """`device[:] = host` (int64, same length) as a kernel on the current stream that reads
    the pinned `host` buffer through unified addressing. The graph path's id upload
    (kvtransfer/copy_graph.py): inside a CUDA graph a host-to-device memcpy node made the
    2,048-token copy graph 134.4 us of device time, this kernel 128.3, against 125.4 for
    the copy kernel alone (benchmarks/kv_copy_sweep.py "part" cases, H200), and it costs
    the graph launch less host time (6.0 against 9.2 us). One load per id crosses PCIe, in
    a few programs; the copy kernels that follow read the device buffer (every program
    reading the pinned ids itself measured 0.141-0.147 ms)."""
    assert host.dtype == device.dtype == torch.int64 and host.shape == device.shape
    n = host.numel()
    if n:
        _stage_ids_kernel[(triton.cdiv(n, _STAGE_BLOCK),)](host, device, n, BLOCK=_STAGE_BLOCK)


def word_bytes_for(src: torch.Tensor, dst: torch.Tensor) -> int:
    """The widest integer word (8, 4, 2 or 1 bytes, never below the element size) that
    tiles every row of both tables: row bytes, layer and unit strides in bytes, and both
    base addresses are multiples of it."""
    elem = src.element_size()
    for word in (8, 4, 2):
        if word <= elem:
            break
        if rows_tile_by(src, word) and rows_tile_by(dst, word):
            return word
    return elem


def launch_shape(num_rows: int, num_words: int, num_sms: int) -> tuple[int, int]:
    """(words per load, words per program) for `num_rows` rows of `num_words` words."""
    block = min(triton.next_power_of_2(num_words), _TILE_WORDS)
    tiles_per_row = triton.cdiv(num_words, block)
    tiles = min(tiles_per_row, _MAX_TILES_PER_PROGRAM)
    while (
        tiles > 1 and num_rows * triton.cdiv(tiles_per_row, tiles) < _MIN_PROGRAMS_PER_SM * num_sms
    ):
        tiles //= 2
    return block, tiles * block


class _Pair:
    """What a launch between two tables needs that does not change from pull to pull: the
    word views, their strides, the device's SM count, and the launch shape per id count.
    A pull's host time is mostly such Python (~0.2 ms on the H200 host before this, with
    the kernel's own device time 0.14 ms for a 2,048-token request), so it is worked out
    once per pair of tables."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        _check_tables(src, dst)
        self.src, self.dst = src, dst  # held: the cache keys on their identities
        word = word_bytes_for(src, dst)
        self.src_words, self.dst_words = bitwise_view(src, word), bitwise_view(dst, word)
        self.num_layers, _, self.num_words = self.src_words.shape
        self.strides = (
            self.src_words.stride(0), self.src_words.stride(1),
            self.dst_words.stride(0), self.dst_words.stride(1),
        )  # fmt: skip
        self.num_sms = num_sms(src.device)
        self.shapes: dict[int, tuple[int, int, int]] = {}
        # The counted copy runs as kernels/kv_copy_cuda.py's kernel where it can (None:
        # not decided yet).
        self._cuda_counted: bool | None = None

    def launch(self, ids: torch.Tensor, offset: int, n: int) -> None:
        if n == 0 or self.num_words == 0 or self.num_layers == 0:
            return
        shape = self.shapes.get(n)
        if shape is None:
            block, chunk = launch_shape(n * self.num_layers, self.num_words, self.num_sms)
            chunks_per_row = triton.cdiv(self.num_words, chunk)
            programs = n * self.num_layers * chunks_per_row
            assert programs <= _MAX_GRID_X, f"{programs} programs pass CUDA's grid x limit"
            shape = self.shapes[n] = (block, chunk, chunks_per_row)
        block, chunk, chunks_per_row = shape
        _copy_units_kernel[(n * self.num_layers * chunks_per_row,)](
            self.src_words, self.dst_words, ids, offset, n, *self.strides,
            self.num_layers, self.num_words, chunks_per_row,
            CHUNK=chunk, BLOCK=block, EVEN=self.num_words % chunk == 0, num_warps=_NUM_WARPS,
        )  # fmt: skip

    def launch_counted(self, ids: torch.Tensor, count_offset: int, capacity: int) -> None:
        """The counted kernel, sized for up to `capacity` ids: the count at
        `ids[count_offset]`, then `capacity` slots of source ids, then `capacity` of
        destination ids (out-of-range ids skipped on the device). Its CUDA C form
        (kernels/kv_copy_cuda.py, 2.4% faster on the H200) where the tables allow, else
        the Triton one here. One program per slot,
        not a persistent loop: on the H200 a fixed grid of 2-16 programs per SM looping
        over the work was 1-3% slower at every shape swept (benchmarks/kv_copy_sweep.py)."""
        if capacity == 0 or self.num_words == 0 or self.num_layers == 0:
            return
        if self._cuda_counted is None:  # decided at the first counted launch (a compile)
            self._cuda_counted = kv_copy_cuda.eligible(
                self.src, self.dst
            ) and kv_copy_cuda.available(self.src.device)
        if self._cuda_counted:
            kv_copy_cuda.launch_counted(
                self.src, self.dst, ids, count_offset, capacity, self.num_sms
            )
            return
        block, chunk = launch_shape(capacity * self.num_layers, self.num_words, self.num_sms)
        chunks_per_row = triton.cdiv(self.num_words, chunk)
        programs = capacity * self.num_layers * chunks_per_row
        assert programs <= _MAX_GRID_X, f"{programs} programs pass CUDA's grid x limit"
        _copy_units_counted_kernel[(programs,)](
            self.src_words, self.dst_words, ids, count_offset, count_offset + 1,
            count_offset + 1 + capacity, self.src_words.shape[1], self.dst_words.shape[1],
            *self.strides, self.num_layers, self.num_words, chunks_per_row,
            CHUNK=chunk, BLOCK=block, EVEN=self.num_words % chunk == 0, num_warps=_NUM_WARPS,
        )  # fmt: skip


class PairCache:
    """`_Pair`s by the identities of their two tables (the storages' `flat()` views, made
    once per storage), at most `limit`; a full cache starts over."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._pairs: dict[tuple[int, int], _Pair] = {}

    def get(self, src: torch.Tensor, dst: torch.Tensor) -> _Pair:
        pair = self._pairs.get((id(src), id(dst)))
        if pair is None or pair.src is not src or pair.dst is not dst:
            if len(self._pairs) >= self.limit:
                self._pairs.clear()
            pair = self._pairs[(id(src), id(dst))] = _Pair(src, dst)
        return pair


def copy_units_counted_ref(
    src: torch.Tensor,  # [L, NU_src, E]
    dst: torch.Tensor,  # [L, NU_dst, E], written in place
    ids: torch.Tensor,  # int64: count, `capacity` source slots, `capacity` destination slots
    count_offset: int,
    capacity: int,
) -> None:
    """The graph path's copy: `n = ids[count_offset]` pairs from the slots after it; a pair
    with an id outside its table is skipped."""
    n = int(ids[count_offset])
    s = ids[count_offset + 1 : count_offset + 1 + n].long().cpu()
    d = ids[count_offset + 1 + capacity : count_offset + 1 + capacity + n].long().cpu()
    ok = (s >= 0) & (s < src.shape[1]) & (d >= 0) & (d < dst.shape[1])
    copy_units_ref(src, s[ok].to(src.device), dst, d[ok].to(dst.device))


def copy_units_counted(
    src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, count_offset: int, capacity: int
) -> None:
    """`copy_units_counted_ref` as the counted kernel (one launch shape for every count up
    to `capacity`, so it can be graph-captured). `ids` is int64 on the tables' device."""
    _check_tables(src, dst)
    assert ids.dtype == torch.int64 and ids.dim() == 1, "ids are a flat int64 buffer"
    assert ids.numel() >= count_offset + 1 + 2 * capacity, "ids shorter than the capacity"
    assert ids.device == src.device == dst.device, "ids and tables on one device"
    _Pair(src, dst).launch_counted(ids, count_offset, capacity)


def _joined(src_ids: torch.Tensor, dst_ids: torch.Tensor) -> torch.Tensor:
    """The kernel's id buffer: source ids, then destination ids, int64."""
    return torch.cat([src_ids.to(torch.int64), dst_ids.to(torch.int64)])


def copy_units_triton(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    _check(src, src_ids, dst, dst_ids)
    _Pair(src, dst).launch(_joined(src_ids, dst_ids), 0, src_ids.numel())


def copy_units_direct(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    peer: bool = False,
) -> None:
    """CUDA tensors on one device -> the Triton kernel; with `peer` (the caller enabled
    peer access between two CUDA devices), the kernel on src's device writing dst over
    the link, ids on src's device; otherwise the torch reference.

    Why the source's device: a CUDA IPC mapping of another process's memory is usable
    only from the device it was opened on (Triton refuses its pointer in another device's
    context, H200 x2), while plain allocations of a peer are fine both ways. Writing
    over NVLink measured as fast as reading (338 vs 342 GB/s, benchmarks/peer_copy.py)."""
    _check(src, src_ids, dst, dst_ids)
    if _kernel_copies(src, dst, peer):
        copy_units_joined(_Pair(src, dst), _joined(src_ids, dst_ids), 0, src_ids.numel(), peer)
    else:
        copy_units_ref(src, src_ids, dst, dst_ids)


def _kernel_copies(src: torch.Tensor, dst: torch.Tensor, peer: bool) -> bool:
    return src.is_cuda and (src.device == dst.device or (peer and dst.is_cuda))


def copy_units_joined(pair: _Pair, ids: torch.Tensor, offset: int, n: int, peer: bool) -> None:
    """The kernel over `pair`'s tables: `ids[offset : offset + n]` are source unit ids and
    the next n destination ones (int64, on the source's device, checked by the caller:
    the kernel trusts them). The pull path (`kvtransfer.pack.copy_groups`): one id buffer
    for every group, no per-call views or checks."""
    if peer and pair.src.device != pair.dst.device:
        with torch.cuda.device(pair.src.device):
            pair.launch(ids, offset, n)
    else:
        pair.launch(ids, offset, n)


def _check(src, src_ids, dst, dst_ids) -> None:
    _check_tables(src, dst)
    assert src_ids.shape == dst_ids.shape and src_ids.dim() == 1, "one source id per destination"


def _check_tables(src: torch.Tensor, dst: torch.Tensor) -> None:
    assert src.dim() == 3 and dst.dim() == 3, "storages are [L, NU, E]"
    assert src.dtype == dst.dtype, f"dtypes differ: {src.dtype} vs {dst.dtype}"
    assert src.shape[0] == dst.shape[0] and src.shape[2] == dst.shape[2], (
        f"[L, *, E] differ: {tuple(src.shape)} vs {tuple(dst.shape)}"
    )
    assert src.stride(2) == 1 and dst.stride(2) == 1, "the E axis must be contiguous"
