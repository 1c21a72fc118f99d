"""A decode layer's o projection, gate/up and down as one CUDA launch that streams every
phase's weights from its first cycle (NVRTC-compiled, as kernels/kv_copy_cuda.py is).

Why: at 32 rows the three Triton skinny launches take ~17.8 us a layer on the H200 for
23 MB of weights (5.4 us at the copy engine's 4.28 TB/s). Each launch starts its weight
stream only once it runs, and a small stream is mostly start-up. A Triton persistent form
with grid barriers (each phase loading after its barrier) was slower still: 19.1 us
(docs/benchmark-history.md). Here each program (one per SM) asks for its o and gate/up
weight tiles with Hopper bulk copies (`cp.async.bulk`, completion on an mbarrier) before
anything else, and for its down tile as soon as the o tile is consumed, so the weights
arrive while the phases before them compute and wait for each other.

Contract (spec: `mlp_block_ref`, the folded chain's three skinny calls): from the
attention output `a` [M, KO] and the residual stream `r` [M, H] with norm weights folded
into `w_gu` (runner/models/norm_fold.py),
    r1 = r + a @ w_o.T                          (rounded, then the sum rounded)
    h = silu_and_mul(s(r1) * (r1 @ w_gu.T))     (s: the post-attention RMSNorm factor)
    r2 = r1 + h @ w_d.T
and r2's row sums of squares in `MlpBlockConfig.sq_parts` parts (kernels/row_squares.py).
The rounding points are the skinny kernel's; sums run in a different order (split-K
partials of 8 splits here), so results agree to fp32 summation order, not bitwise.

It applies to 16-bit weights without biases, M <= 32 rows, shapes `choose_config` can tile
(multiples of 16/64, the tiles fitting one program per SM); otherwise, and without NVRTC or
Hopper bulk copies (compute capability < 9.0), the caller runs the Triton chain.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.activation import silu_and_mul_ref
from pdserve.kernels.mlp_block_source import SOURCE
from pdserve.kernels.row_squares import MAX_PARTS, SQ_ROWS, RowSquares, squares_buffer
from pdserve.kernels.skinny_linear import residual_linear_ref
from pdserve.kernels.workspace import KernelWorkspace

logger = logging.getLogger(__name__)

ROWS = 32  # batch rows one launch multiplies (4 MMA column tiles of 8)
THREADS = 256
ROW_PAD = 16  # bytes after each shared weight/input row: 8 ldmatrix rows, 8 bank groups
MAX_SMEM = 227 * 1024  # an H100/H200 program's opt-in shared memory
_BN = 64  # o / down output features a program (4 warps of 16 rows)
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@dataclass(frozen=True)
class MlpBlockConfig:
    hidden: int  # H: the residual stream's width
    attn_width: int  # KO: the o projection's input width (heads x head_dim)
    inter: int  # I: the MLP's intermediate width
    bf16: bool
    o_splits: int  # K splits of each o output tile
    gu_features: int  # gate/up features a program (gate and up rows: 2x that, <= 128)
    gu_splits: int
    d_splits: int
    # 0: weights streamed ahead; 1 (each phase's copy when it starts) and 2 (no weights:
    # wrong results, the sync and compute chain alone) exist for benchmarks/mlp_block_probe.py.
    weights_mode: int = 0
    barrier_mode: int = 0  # 1: release atomics, no trailing fence (the probe's variant)
    # The K splits of an o / down tile as one thread-block cluster: partials exchanged in
    # distributed shared memory instead of through L2 and a counter.
    cluster: bool = False
    gu_multicast: bool = False  # cluster only, unsplit gate/up: r_mid multicast in the cluster

    @property
    def o_tiles(self) -> int:
        return self.hidden // _BN

    @property
    def gu_tiles(self) -> int:
        return self.inter // self.gu_features

    @property
    def k_halves(self) -> tuple[int, int, int]:
        """K ranges a tile's warps share (o, gate/up, down): 8 warps over the row tiles."""
        warps = THREADS // 32
        return warps // (_BN // 16), warps // (2 * self.gu_features // 16), warps // (_BN // 16)

    @property
    def grid(self) -> int:
        return max(self.o_tiles * self.o_splits, self.gu_tiles * self.gu_splits,
                   self.o_tiles * self.d_splits)  # fmt: skip

    @property
    def sq_parts(self) -> int:
        """Parts of the output's row sums of squares: one per down program."""
        return self.o_tiles * self.d_splits

    def _slices(self) -> tuple[int, int, int]:
        return (self.attn_width // self.o_splits, self.hidden // self.gu_splits,
                self.inter // self.d_splits)  # fmt: skip

    @property
    def regions(self) -> tuple[int, int, int]:
        """Shared bytes of region A (o, then down tile), B (gate/up tile), X (inputs)."""
        o_bk, gu_bk, d_bk = self._slices()
        row = lambda k: k * 2 + ROW_PAD  # noqa: E731
        gu_partial = self.k_halves[1] * 2 * self.gu_features * ROWS * 4  # X holds it unsplit
        return (
            _BN * max(row(o_bk), row(d_bk)),
            2 * self.gu_features * row(gu_bk),
            max(ROWS * row(max(o_bk, gu_bk, d_bk)), gu_partial),
        )

    @property
    def smem_bytes(self) -> int:
        # + reduction scratch [8, 32] fp32, the row scales [32] fp32, 4 mbarriers
        return sum(self.regions) + (THREADS // 32 + 1) * ROWS * 4 + 4 * 8

    @property
    def partials(self) -> int:
        """fp32 partials of one launch: o, gate/up, down."""
        o_kh, gu_kh, d_kh = self.k_halves
        return ROWS * (self.o_tiles * self.o_splits * o_kh * _BN
                       + self.gu_tiles * self.gu_splits * gu_kh * 2 * self.gu_features
                       + self.o_tiles * self.d_splits * d_kh * _BN)  # fmt: skip

    @property
    def counters(self) -> int:
        return 2 + 2 * self.o_tiles + self.gu_tiles

    def defines(self) -> str:
        o_bk, gu_bk, d_bk = self._slices()
        o_kh, gu_kh, d_kh = self.k_halves
        a, b, x = self.regions
        values = {
            "IS_BF16": int(self.bf16), "H": self.hidden, "KO": self.attn_width,
            "I": self.inter, "O_BN": _BN, "O_BK": o_bk, "O_KS": self.o_splits,
            "O_NT": self.o_tiles, "GU_BF": self.gu_features, "GU_BK": gu_bk,
            "GU_KS": self.gu_splits, "GU_NT": self.gu_tiles, "D_BN": _BN, "D_BK": d_bk,
            "D_KS": self.d_splits, "D_NT": self.o_tiles, "REGION_A": a, "REGION_B": b,
            "REGION_X": x, "SQ_STRIDE": SQ_ROWS, "WEIGHTS_MODE": self.weights_mode,
            "BARRIER_MODE": self.barrier_mode, "CLUSTER": int(self.cluster),
            "GU_MULTICAST": int(self.gu_multicast),
            "O_KH": o_kh, "GU_KH": gu_kh, "D_KH": d_kh,
        }  # fmt: skip
        return "".join(f"#define {k} {v}\n" for k, v in values.items())


def _splits(tiles: int, k: int, max_programs: int) -> int:
    """The most K splits (slices of a multiple of 16) with tiles x splits <= max_programs."""
    best = 0
    for s in range(1, max_programs // max(tiles, 1) + 1):
        if k % s == 0 and (k // s) % 16 == 0:
            best = s
    return best


@functools.cache
def choose_config(hidden: int, attn_width: int, inter: int, dtype: torch.dtype,
                  num_sms: int) -> MlpBlockConfig | None:  # fmt: skip
    """Tiles filling up to one program per SM, or None where the shapes do not tile.

    o and down: 64-feature output tiles, K split as far as the SMs allow (Qwen3-0.6B: 16
    tiles x 8 splits). gate/up: the most programs, then the fewest splits (3,072 features:
    48 a program, 2 splits: 128 programs), within the shared memory."""
    if dtype not in (torch.bfloat16, torch.float16) or hidden % _BN:
        return None
    o_tiles = hidden // _BN
    o_splits = _splits(o_tiles, attn_width, num_sms)
    d_splits = _splits(o_tiles, inter, num_sms)
    if not (o_splits and d_splits) or o_tiles * d_splits > MAX_PARTS:
        return None
    best = None
    for feats in range(8, 65, 8):
        if inter % feats:
            continue
        splits = _splits(inter // feats, hidden, num_sms)
        if not splits:
            continue
        cfg = MlpBlockConfig(hidden, attn_width, inter, dtype == torch.bfloat16, o_splits,
                             feats, splits, d_splits)  # fmt: skip
        if cfg.smem_bytes > MAX_SMEM:
            continue
        key = (cfg.gu_tiles * splits, -splits)
        if best is None or key > best[0]:
            best = (key, cfg)
    return None if best is None else _with_clusters(best[1])


_MAX_CLUSTER = 8  # the portable cluster size


def _with_clusters(cfg: MlpBlockConfig) -> MlpBlockConfig:
    """Clusters where every program is one split of an o tile and of a down tile (so the
    grid is whole clusters), multicast of the gate/up input where its tiles are unsplit."""
    if not (cfg.o_splits == cfg.d_splits <= _MAX_CLUSTER and cfg.o_splits > 1):
        return cfg
    if cfg.grid != cfg.o_tiles * cfg.o_splits:
        return cfg
    return dataclasses.replace(cfg, cluster=True, gu_multicast=cfg.gu_splits == 1)


@functools.cache
def _kernel(device_index: int, cfg: MlpBlockConfig) -> object | None:
    """The compiled kernel for one device and config, or None where it cannot be built."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None or torch.cuda.get_device_capability(device_index)[0] < 9:
        return None
    try:
        with torch.cuda.device(device_index):
            kernel = compile_kernel(cfg.defines() + SOURCE, "mlp_block")
        lib = torch.cuda._utils._get_gpu_runtime_library()
        err = lib.cuFuncSetAttribute(
            kernel.func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cfg.smem_bytes
        )
        if err != 0:
            raise RuntimeError(f"cuFuncSetAttribute gave CUresult {err}")
        return kernel
    except Exception as e:  # noqa: BLE001 - any build failure means: run the Triton chain
        logger.warning("CUDA MLP block kernel unavailable, the Triton chain runs: %s", e)
        return None


def config_for(attn_out: torch.Tensor, w_o: torch.Tensor, w_gu: torch.Tensor,
               w_d: torch.Tensor, num_sms: int) -> MlpBlockConfig | None:  # fmt: skip
    """The config this layer and batch run with, or None: use the Triton chain."""
    rows = attn_out.shape[0]
    if not (attn_out.is_cuda and 0 < rows <= ROWS):
        return None
    hidden, attn_width = w_o.shape
    inter = w_d.shape[1]
    if w_gu.shape != (2 * inter, hidden) or w_d.shape != (hidden, inter):
        return None
    if not all(t.is_contiguous() and t.dtype == attn_out.dtype for t in (w_o, w_gu, w_d)):
        return None
    cfg = choose_config(hidden, attn_width, inter, attn_out.dtype, num_sms)
    device = attn_out.device.index or 0
    if cfg is not None and cfg.cluster and not _clusters_fit(device, cfg):
        cfg = dataclasses.replace(cfg, cluster=False, gu_multicast=False)
    if cfg is None or cfg.grid > num_sms or _kernel(device, cfg) is None:
        return None
    return cfg


@functools.cache
def _clusters_fit(device_index: int, cfg: MlpBlockConfig) -> bool:
    """Whether all of the grid's clusters can be resident at once (clusters are placed
    within a GPC, so 128 programs on 132 SMs in clusters of 8 need 16 GPC slots)."""
    kernel = _kernel(device_index, cfg)
    if kernel is None:
        return False
    attrs = (_LaunchAttr * 1)()
    attrs[0].id = _ATTR_CLUSTER_DIMENSION
    attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = cfg.o_splits, 1, 1
    launch = _LaunchConfig(
        (ctypes.c_uint * 3)(cfg.grid, 1, 1), (ctypes.c_uint * 3)(THREADS, 1, 1),
        cfg.smem_bytes, None, attrs, 1,
    )  # fmt: skip
    count = ctypes.c_int(0)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    with torch.cuda.device(device_index):
        err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), kernel.func,
                                               ctypes.byref(launch))  # fmt: skip
    if err != 0 or count.value * cfg.o_splits < cfg.grid:
        logger.info(
            "MLP block clusters do not fit (%s, %d clusters): unclustered", err, count.value
        )
        return False
    return True


def mlp_block_ref(attn_out, residual, w_o, w_gu, w_d, eps):
    """The spec: the folded chain's o (+ residual), scaled gate/up with SiLU-and-mul and down
    (+ residual) -> (the new stream, its rows' sums of squares)."""
    r1, sq = residual_linear_ref(attn_out, w_o, None, residual)
    s = torch.rsqrt(sq / residual.shape[1] + eps)
    h = silu_and_mul_ref((F.linear(r1.float(), w_gu.float()) * s[:, None]).to(r1.dtype))
    return residual_linear_ref(h, w_d, None, r1)


def mlp_block_cuda(
    attn_out: torch.Tensor,  # [M <= 32, KO]
    residual: torch.Tensor,  # [M, H]
    w_o: torch.Tensor,  # [H, KO]
    w_gu: torch.Tensor,  # [2 I, H]
    w_d: torch.Tensor,  # [H, I]
    eps: float,
    workspace: KernelWorkspace,
    cfg: MlpBlockConfig,  # from config_for
    stamps: torch.Tensor | None = None,  # [grid, 16] int64: phase timestamps (the probe's)
) -> tuple[torch.Tensor, RowSquares]:
    """Queue the block on the current stream (graph-capturable): the new residual stream and
    its row sums of squares in the workspace's squares buffer."""
    rows = attn_out.shape[0]
    dev = attn_out.device
    assert attn_out.stride(1) == 1 and residual.stride(1) == 1, "features are contiguous"
    assert attn_out.stride(0) % 8 == 0 and residual.stride(0) % 8 == 0, "rows 16-byte aligned"
    assert residual.shape == (rows, cfg.hidden) and residual.dtype == attn_out.dtype
    r_mid = torch.empty((rows, cfg.hidden), dtype=attn_out.dtype, device=dev)
    act = torch.empty((rows, cfg.inter), dtype=attn_out.dtype, device=dev)
    r_out = torch.empty((rows, cfg.hidden), dtype=attn_out.dtype, device=dev)
    part = workspace.scratch("mlp_block_partials", cfg.partials, dev)
    sq_mid = workspace.scratch("mlp_block_squares", cfg.o_tiles * cfg.o_splits * ROWS, dev)
    sq_out = squares_buffer(workspace, dev)
    counters = workspace.epoch_counters("mlp_block", cfg.counters, dev)
    args = [
        *(ctypes.c_void_p(t.data_ptr()) for t in (
            attn_out, residual, w_o, w_gu, w_d, r_mid, act, r_out, part, sq_mid, sq_out,
            counters)),
        ctypes.c_int(rows), ctypes.c_int(attn_out.stride(0)), ctypes.c_int(residual.stride(0)),
        ctypes.c_float(eps),
        ctypes.c_void_p(0 if stamps is None else stamps.data_ptr()),
    ]  # fmt: skip
    params = (ctypes.c_void_p * len(args))(
        *[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args]
    )
    kernel = _kernel(dev.index or 0, cfg)
    assert kernel is not None, "mlp_block_cuda without a kernel: check config_for first"
    stream = torch.cuda.current_stream(dev)
    _launch(kernel.func, cfg, stream.cuda_stream, params)
    return r_out, RowSquares(sq_out, cfg.sq_parts, cfg.hidden)


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)),
        ("num_attrs", ctypes.c_uint),
    ]  # fmt: skip


_ATTR_COOPERATIVE, _ATTR_CLUSTER_DIMENSION = 2, 4


def _launch(func, cfg: MlpBlockConfig, stream: int, params) -> None:
    """Every program must be resident at once (they wait for each other): a cooperative
    launch, or with clusters of `o_splits` programs when `cfg.cluster` (which
    `_clusters_fit` checked all fit; a program that could not start would make the others
    trap at their spin limit rather than hang)."""
    attrs = (_LaunchAttr * 1)()
    if cfg.cluster:
        attrs[0].id = _ATTR_CLUSTER_DIMENSION
        attrs[0].value[0], attrs[0].value[1], attrs[0].value[2] = cfg.o_splits, 1, 1
    else:
        attrs[0].id = _ATTR_COOPERATIVE
        attrs[0].value[0] = 1
    n = 1
    launch = _LaunchConfig(
        (ctypes.c_uint * 3)(cfg.grid, 1, 1), (ctypes.c_uint * 3)(THREADS, 1, 1),
        cfg.smem_bytes, ctypes.c_void_p(stream), attrs, n,
    )  # fmt: skip
    lib = torch.cuda._utils._get_gpu_runtime_library()
    err = lib.cuLaunchKernelEx(ctypes.byref(launch), func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx of mlp_block failed with CUresult {err}")
