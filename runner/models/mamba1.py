"""The Mamba (Mamba1) token mixer of Jamba (runner/models/mamba_hybrid.py), over per-request
state units (runner/mrv2/mamba_state.py, runner/state_pool.py).

Per token, as transformers' JambaMambaMixer:
- `in_proj` gives the conv input and the gate z (d_inner each);
- a causal depthwise conv (K taps, continuing from the unit's last K-1 inputs), SiLU: u;
- `x_proj(u)` gives the time-step rank's input, B and C (state N each), each RMS-normed
  (Jamba's dt / B / C norms); dt = softplus(dt_proj(...)) per channel;
- the selective scan per channel d and state n: h = exp(dt A) h + dt u B, y = h . C + D u;
- y * silu(z) through `out_proj`.
The state is the conv's last K-1 inputs `[K-1, d_inner]` and h `[d_inner, N]` (float32).

The convolution runs a prompt row at a time and the decode rows at once; x_proj, the
norms and dt_proj over the step's tokens at once; then the scan over every row
(kernels/selective_scan.py: A is a matrix, so the Mamba2 mixer's chunked form does not
apply, and the recurrence runs token by token: on a GPU one Triton launch, on the CPU its
torch spec). A decode step reads nothing from the host, so decode graphs capture it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.selective_scan import selective_scan
from pdserve.runner.models.mamba2 import MambaStep, conv_row_inputs, conv_step_windows

if TYPE_CHECKING:
    from pdserve.runner.lora.slots import LoraSite


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Mamba1Mixer(nn.Module):
    def __init__(self, cfg: Any, state_index: int):
        super().__init__()
        self.state_index = state_index  # this layer's index into the state tensors
        hidden, inner = cfg.hidden_size, cfg.mamba_expand * cfg.hidden_size
        self.inner, self.state, self.rank = inner, cfg.mamba_d_state, int(cfg.mamba_dt_rank)
        self.conv_kernel = cfg.mamba_d_conv
        bias = bool(cfg.mamba_proj_bias)
        self.in_proj = nn.Linear(hidden, 2 * inner, bias=bias)
        self.conv1d = nn.Conv1d(inner, inner, self.conv_kernel, groups=inner,
                                bias=bool(cfg.mamba_conv_bias))  # fmt: skip
        self.x_proj = nn.Linear(inner, self.rank + 2 * self.state, bias=False)
        self.dt_proj = nn.Linear(self.rank, inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(inner, self.state))
        self.D = nn.Parameter(torch.empty(inner))
        self.out_proj = nn.Linear(inner, hidden, bias=bias)
        eps = cfg.rms_norm_eps
        self.dt_layernorm = _RMSNorm(self.rank, eps)
        self.b_layernorm = _RMSNorm(self.state, eps)
        self.c_layernorm = _RMSNorm(self.state, eps)
        # LoRA adapters' sites (runner/lora/slots.py), when the engine serves them
        self.in_lora: LoraSite | None = None
        self.out_lora: LoraSite | None = None

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One unit's conv state and SSM state in one layer."""
        return (self.conv_kernel - 1, self.inner), (self.inner, self.state)

    def forward(
        self, x: torch.Tensor, step: MambaStep, conv: torch.Tensor, ssm: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `conv` [units, K-1, d_inner] and `ssm` [units,
        d_inner, N] (this layer's) are read and written at the rows' units."""
        xz = self.in_proj(x)
        if self.in_lora is not None:
            xz = self.in_lora.apply(xz, x)
        xs, z = xz.split([self.inner, self.inner], dim=-1)
        counts = np.diff(step.query_start)
        if (counts == 1).all():  # a decode step (no index copies: graph-capturable)
            u = self._conv_steps(xs, step.units, step.fresh_dev, conv, x.dtype)
            query_start = None
        else:
            u = torch.empty_like(xs)
            single = np.flatnonzero(counts == 1)  # decode rows (and one-token chunks)
            if single.size:
                at = torch.from_numpy(step.query_start[single]).to(x.device, non_blocking=True)
                on = torch.from_numpy(single).to(x.device, non_blocking=True)
                units, fresh = step.units[on], step.fresh_dev[on]
                u[at] = self._conv_steps(xs[at], units, fresh, conv, x.dtype)
            for r in np.flatnonzero(counts > 1).tolist():
                first, end = int(step.query_start[r]), int(step.query_start[r + 1])
                full = conv_row_inputs(conv, step.units[r], bool(step.fresh[r]), xs[first:end])
                u[first:end] = self._conv(full.unfold(0, self.conv_kernel, 1), x.dtype)
            query_start = torch.from_numpy(step.query_start).to(x.device, non_blocking=True)
        delta, b, c = self._coefficients(u)
        a = -torch.exp(self.A_log.float())  # [D, N]
        # kernels/selective_scan.py: one launch over every row's tokens on a GPU
        y = selective_scan(ssm, step.units, step.fresh_dev, query_start, u.float(), delta, a,
                           b, c, self.D.float())  # fmt: skip
        out = (y * F.silu(z.float())).to(x.dtype)
        result = self.out_proj(out)
        return result if self.out_lora is None else self.out_lora.apply(result, out)

    def _conv(self, windows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, D, K] windows of conv inputs -> u [T, D] in the model's dtype (conv, SiLU)."""
        out = (windows.float() * self.conv1d.weight[:, 0, :].float()[None]).sum(-1)
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias.float()
        return F.silu(out).to(dtype)

    def _conv_steps(self, xs, units, fresh, conv, dtype) -> torch.Tensor:
        """One token a row, these rows' conv steps at once -> u [R, D]."""
        return self._conv(conv_step_windows(conv, units, fresh, xs).transpose(1, 2), dtype)

    def _coefficients(self, u: torch.Tensor):
        """u [T, D] -> (delta [T, D], B [T, N], C [T, N]), contiguous float32."""
        dt, b, c = self.x_proj(u).split([self.rank, self.state, self.state], dim=-1)
        dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        delta = F.softplus(dt.float() @ self.dt_proj.weight.float().T + self.dt_proj.bias.float())
        return delta, b.float().contiguous(), c.float().contiguous()
