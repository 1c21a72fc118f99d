"""The Mamba2 token mixer of hybrid models (Bamba: runner/models/mamba_hybrid.py) over per-request
state units (runner/mrv2/mamba_state.py, runner/state_pool.py).

One mixer step over a batch's rows (each row a request's new tokens, maybe a chunk of its
prompt, maybe one decode token):
- `in_proj` gives the gate z, the conv input xBC and the time steps dt;
- xBC passes a causal depthwise convolution of width K that continues from the row's
  last K-1 inputs (its conv state; zeros for a request's first chunk), then SiLU;
- x (heads x head_dim), B and C (groups x state) drive the selective scan (SSD): per
  head, `S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`, `y_t = S_t C_t + D x_t`, from the
  row's SSM state; dt is softplus(dt + dt_bias), clamped to `time_step_limit`;
- y * silu(z) is RMS-normalised per group and goes through `out_proj`.
A row's final conv and SSM states are written back to its request's unit.

The scan of a row's tokens runs in the chunked (quadratic within a chunk of
`mamba_chunk_size` tokens, recurrent across chunks) form; decode rows (one token each)
update their states in one batched recurrence. The SSM state and the scan are float32.
This is the torch path (CPU, and the GPU eagerly); models with Mamba layers capture no
CUDA graphs (runner/config_resolve.py, runner/hybrid.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.ssm_update import ssm_decode

if TYPE_CHECKING:
    from pdserve.runner.lora.slots import LoraSite

# Bytes a group of prompt rows may spend on one scan chunk's [G, L, L, heads] float32
# score and decay tensors (the scan's largest): a Granite-4.0-H-Tiny layer (48 heads,
# 256-token chunks) takes 21 rows a group.
SCAN_BYTES = 256 << 20


@dataclass
class MambaStep:
    """What a step's Mamba layers read about its rows (set by MambaModelState.prepare)."""

    units: torch.Tensor  # [R] int64 device: each row's state unit
    query_start: np.ndarray  # [R + 1] host: row r's tokens are [qs[r], qs[r + 1])
    fresh: np.ndarray  # [R] bool host: the row's first tokens (its state starts at zero)
    fresh_dev: torch.Tensor  # [R] bool device, the same


@dataclass(frozen=True)
class Mamba2Dims:
    hidden: int
    heads: int
    head_dim: int
    groups: int
    state: int
    conv_kernel: int
    chunk: int
    eps: float
    dt_min: float
    dt_max: float
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj's and out_proj's

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


def mamba2_dims(cfg: Any) -> Mamba2Dims:
    """The mixer's geometry as the family's config names it: NemotronH's keys, or Bamba's
    (`mamba_*`, which Granite 4.0-H shares)."""
    limit = getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))
    if cfg.model_type == "nemotron_h":
        dims = Mamba2Dims(
            cfg.hidden_size, int(cfg.mamba_num_heads), int(cfg.mamba_head_dim),
            int(cfg.n_groups), int(cfg.ssm_state_size), int(cfg.conv_kernel),
            int(cfg.chunk_size), float(cfg.layer_norm_epsilon), float(limit[0]),
            float(limit[1]), bool(cfg.use_conv_bias), bool(cfg.use_bias),
        )  # fmt: skip
    else:
        dims = Mamba2Dims(
            cfg.hidden_size, int(cfg.mamba_n_heads), int(cfg.mamba_d_head),
            int(cfg.mamba_n_groups), int(cfg.mamba_d_state), int(cfg.mamba_d_conv),
            int(cfg.mamba_chunk_size), float(cfg.rms_norm_eps), float(limit[0]),
            float(limit[1]), bool(getattr(cfg, "mamba_conv_bias", True)),
            bool(getattr(cfg, "mamba_proj_bias", False)),
        )  # fmt: skip
    assert dims.heads % dims.groups == 0, "the groups divide the Mamba heads"
    return dims


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: Any, state_index: int):
        super().__init__()
        d = self.dims = mamba2_dims(cfg)
        self.state_index = state_index  # this layer's index into the state tensors
        bias = d.proj_bias
        self.in_proj = nn.Linear(d.hidden, d.inner + d.conv_dim + d.heads, bias=bias)
        # [conv_dim, 1, K], as the checkpoint stores a depthwise Conv1d
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim,
                                bias=d.conv_bias)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.empty(d.heads))
        self.A_log = nn.Parameter(torch.empty(d.heads))
        self.D = nn.Parameter(torch.empty(d.heads))
        self.norm = GatedRMSNorm(d.inner, d.inner // d.groups, d.eps)
        self.out_proj = nn.Linear(d.inner, d.hidden, bias=bias)
        # LoRA adapters' sites (runner/lora/slots.py), when the engine serves them
        self.in_lora: LoraSite | None = None
        self.out_lora: LoraSite | None = None

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One unit's conv state and SSM state in one layer."""
        d = self.dims
        return (d.conv_kernel - 1, d.conv_dim), (d.heads, d.head_dim, d.state)

    def forward(
        self, x: torch.Tensor, step: MambaStep, conv: torch.Tensor, ssm: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] (the rows' tokens in order) -> [T, hidden]; `conv` [units, K-1,
        conv_dim] and `ssm` [units, heads, head_dim, state] (this layer's) are read and
        written at the rows' units."""
        d = self.dims
        zxbcdt = self.in_proj(x)
        if self.in_lora is not None:
            zxbcdt = self.in_lora.apply(zxbcdt, x)
        z, xbc, dt = zxbcdt.split([d.inner, d.conv_dim, d.heads], dim=-1)
        counts = np.diff(step.query_start)
        y = torch.zeros(x.shape[0], d.inner, dtype=torch.float32, device=x.device)
        single = counts == 1  # decode rows (and one-token chunks): one batched recurrence
        if single.all():
            n = len(counts)
            y[:n] = self._decode(xbc[:n], dt[:n], step.units, step.fresh_dev, conv, ssm)
        else:
            if single.any():
                rows = np.flatnonzero(single)
                at = torch.from_numpy(step.query_start[rows]).to(x.device, non_blocking=True)
                on = torch.from_numpy(rows).to(x.device, non_blocking=True)
                y[at] = self._decode(xbc[at], dt[at], step.units[on], step.fresh_dev[on],
                                     conv, ssm)  # fmt: skip
            for rows in self._row_groups(counts, np.flatnonzero(~single)):
                self._segments(xbc, dt, step, rows, conv, ssm, y)
        out = self.norm(y, z.float()).to(x.dtype)
        y = self.out_proj(out)
        return y if self.out_lora is None else self.out_lora.apply(y, out)

    # ---- parts ----------------------------------------------------------------------

    def _conv(self, windows: torch.Tensor, split=None):
        """Each token's window of K conv inputs [N, C, K] -> (x, B, C) of `split` (default
        `_split`), after the depthwise convolution and SiLU."""
        out = (windows.float() * self.conv1d.weight[:, 0, :].float()[None]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.float()
        return (split or self._split)(F.silu(out))

    def _time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        d = self.dims
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if d.dt_min > 0.0 or d.dt_max != float("inf"):
            dt = dt.clamp(d.dt_min, d.dt_max)
        return dt

    def _split_groups(self, xbc: torch.Tensor):
        """-> x [T, heads, head_dim], B and C [T, groups, state], float32, contiguous."""
        d = self.dims
        x, b, c = xbc.float().split([d.inner, d.groups * d.state, d.groups * d.state], dim=-1)
        t = x.shape[0]
        # slices of one [T, C] row block: made contiguous, as the decode kernels read them
        return (x.reshape(t, d.heads, d.head_dim).contiguous(),
                b.reshape(t, d.groups, d.state).contiguous(),
                c.reshape(t, d.groups, d.state).contiguous())  # fmt: skip

    def _split(self, xbc: torch.Tensor):
        """`_split_groups` with B and C per head, [T, heads, state]."""
        d = self.dims
        x, b, c = self._split_groups(xbc)
        per = d.heads // d.groups  # heads sharing a group's B and C
        t = x.shape[0]
        b = b.view(t, d.groups, 1, d.state).expand(t, d.groups, per, d.state)
        c = c.view(t, d.groups, 1, d.state).expand(t, d.groups, per, d.state)
        return x, b.reshape(t, d.heads, d.state), c.reshape(t, d.heads, d.state)

    def _row_groups(self, counts: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
        """The prompt rows in groups scanned together: longest first, so a group's rows pad
        to similar lengths, and few enough that a group's per-chunk score tensors
        ([G, L, L, heads] float32) stay within SCAN_BYTES."""
        d = self.dims
        per_row = min(d.chunk, int(counts[rows].max())) ** 2 * d.heads * 4
        size = max(1, SCAN_BYTES // per_row)
        chunks = -(-counts[rows] // d.chunk)  # rows of one chunk count pad by < a chunk
        groups = []
        for n in np.unique(chunks)[::-1]:
            same = rows[chunks == n]
            same = same[np.argsort(-counts[same], kind="stable")]
            groups += [same[i : i + size] for i in range(0, len(same), size)]
        return groups

    def _segments(self, xbc, dt, step: MambaStep, rows: np.ndarray, conv, ssm, y) -> None:
        """Prompt chunks of several rows at once: each row's tokens padded to the longest
        row's (time step 0 on the pads, so its state passes through them unchanged), the
        convolution from each row's conv state, one chunked scan from each row's SSM
        state; writes the rows' outputs into `y` and their final states back."""
        d, device = self.dims, xbc.device
        starts, ends = step.query_start[rows], step.query_start[rows + 1]
        lengths = ends - starts
        longest = int(lengths.max())
        on = torch.from_numpy(rows).to(device, non_blocking=True)
        units, keep = step.units[on], ~step.fresh_dev[on]
        if len(rows) == 1:  # one row: its tokens are a slice, no pads to gather or mask
            first, end = int(starts[0]), int(ends[0])
            tokens, dt_rows = xbc[first:end][None], dt[first:end][None]
            index = valid = None
        else:
            offsets = np.arange(longest)
            valid_np = offsets[None, :] < lengths[:, None]  # [G, L]
            index_np = np.where(valid_np, starts[:, None] + offsets[None, :], 0)
            index = torch.from_numpy(index_np).to(device, non_blocking=True)
            valid = torch.from_numpy(valid_np).to(device, non_blocking=True)
            tokens, dt_rows = xbc[index], dt[index]
        k = d.conv_kernel - 1
        prev = conv[units] * keep[:, None, None].to(conv.dtype)  # [G, K-1, C]
        full = torch.cat([prev, tokens.to(conv.dtype)], dim=1)  # [G, K-1+L, C]
        last = torch.from_numpy(lengths[:, None] + np.arange(k)[None, :]).to(device)
        conv[units] = full.gather(1, last[..., None].expand(-1, -1, full.shape[2]))
        windows = full.unfold(1, d.conv_kernel, 1)  # [G, L, C, K]
        g = len(rows)
        x, b, c = self._conv(windows.reshape(g * longest, *windows.shape[2:]))
        dts = self._time_steps(dt_rows)  # [G, L, H]
        if valid is not None:
            dts = dts * valid[..., None]  # 0 on the pads
        state = ssm[units].float() * keep[:, None, None, None]
        out, state = ssd_scan(
            x.view(g, longest, d.heads, d.head_dim), dts, -torch.exp(self.A_log.float()),
            b.view(g, longest, d.heads, d.state), c.view(g, longest, d.heads, d.state),
            self.D.float(), state, d.chunk,
        )  # fmt: skip
        ssm[units] = state.to(ssm.dtype)
        if index is None:
            y[int(starts[0]) : int(ends[0])] = out[0].reshape(-1, d.inner)
        else:
            y[index[valid]] = out[valid].reshape(-1, d.inner)

    def _decode(self, xbc, dt, units, fresh, conv, ssm) -> torch.Tensor:
        """One token a row, these rows (their `units`, and which are `fresh`) at once."""
        full = conv_step_windows(conv, units, fresh, xbc)  # [R, K, C]
        x, b, c = self._conv(full.transpose(1, 2), self._split_groups)  # [R, H, P], [R, G, N]
        dt = self._time_steps(dt)  # [R, H]
        a = -torch.exp(self.A_log.float())
        # kernels/ssm_update.py: the state read and written once on a GPU
        y = ssm_decode(ssm, units, fresh, x, dt.contiguous(), a, b, c, self.D.float())
        return y.reshape(y.shape[0], -1)


def conv_step_windows(conv, units, fresh, x) -> torch.Tensor:
    """One token a row: each row's K-1 stored conv inputs (zeros for a fresh row) then its
    new one -> windows [R, K, C]; each unit keeps its last K-1. The Mamba1, Mamba2 and
    Gated DeltaNet decode steps share it."""
    prev = conv[units] * (~fresh)[:, None, None].to(conv.dtype)  # [R, K-1, C]
    full = torch.cat([prev, x.to(conv.dtype)[:, None]], dim=1)  # [R, K, C]
    conv[units] = full[:, 1:]
    return full


def conv_row_inputs(conv, unit, fresh: bool, x) -> torch.Tensor:
    """One row's T tokens after its K-1 stored conv inputs (zeros if fresh) -> [K-1+T, C];
    the unit keeps the last K-1."""
    prev = torch.zeros_like(conv[0]) if fresh else conv[unit]  # [K-1, C]
    full = torch.cat([prev, x.to(conv.dtype)], dim=0)
    conv[unit] = full[full.shape[0] - conv.shape[1] :]
    return full


def ssd_scan(x, dt, a, b, c, d_skip, state, chunk: int):
    """The selective scan of G rows of T tokens each from their `state`s, chunk by chunk.
    x [G, T, H, P], dt [G, T, H], a [H] (negative), b / c [G, T, H, N], d_skip [H], state
    [G, H, P, N] -> (y [G, T, H, P], the final states); all float32. A token with time
    step 0 leaves the state as it is (rows padded to one length end so)."""
    out = []
    for s in range(0, x.shape[1], chunk):
        xs, dts = x[:, s : s + chunk], dt[:, s : s + chunk]
        bs, cs = b[:, s : s + chunk], c[:, s : s + chunk]
        logd = torch.cumsum(dts * a, dim=1)  # [G, L, H]: log decay from the chunk start
        rel = logd[:, :, None, :] - logd[:, None, :, :]  # [G, L(t), L(s), H]
        length = xs.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(rel.masked_fill(~causal[None, :, :, None], float("-inf")))
        scores = torch.einsum("gthn,gshn->gtsh", cs, bs) * decay
        y = torch.einsum("gtsh,gsh,gshp->gthp", scores, dts, xs)
        y = y + torch.einsum("gthn,ghpn->gthp", cs, state) * torch.exp(logd)[..., None]
        out.append(y + d_skip[:, None] * xs)
        to_end = torch.exp(logd[:, -1:] - logd) * dts  # [G, L, H]
        state = state * torch.exp(logd[:, -1])[..., None, None] + torch.einsum(
            "gsh,gshp,gshn->ghpn", to_end, xs, bs
        )
    return torch.cat(out, dim=1), state


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group` features (float32), times the weight."""

    def __init__(self, size: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group, self.eps = group, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y * F.silu(z)
        g = h.view(h.shape[0], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * g.view_as(h)
