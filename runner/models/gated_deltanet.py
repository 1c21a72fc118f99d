"""Qwen3-Next's linear-attention mixer, the gated delta rule (Gated DeltaNet), over state
units like the Mamba mixers' (runner/mrv2/mamba_state.py: a conv state and a recurrent
state per request unit).

Per token: the fused projection gives q, k (per key head), v and the output gate z (per
value head), and b, a (per value head). q, k and v pass a depthwise causal convolution
(kernel K, SiLU) whose last K-1 inputs are the conv state; q and k are L2-normalised and
q is scaled by dk^-1/2; key heads are shared by consecutive value heads. With
beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) <= 0, each value head's
state S [dk, dv] follows

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

and o passes an RMSNorm over dv times silu(z), then the output projection.

A prompt chunk runs in blocks of CHUNK tokens: inside a block, with G the cumulative
sum of g and A[t, i] = exp(G_t - G_i) k_t.k_i for i < t, the updates U solve the unit
lower-triangular system (I + diag(beta) A) U = diag(beta) (V - exp(G) K S0); then
O = exp(G) Q S0 + (QK^T * exp(G_t - G_i), i <= t) U and the block's final state is
exp(G_L) S0 + K^T (exp(G_L - G) U). Decode rows take the recurrence in one batched step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.delta_rule_update import delta_rule_decode
from pdserve.runner.models.mamba2 import MambaStep, conv_row_inputs, conv_step_windows

CHUNK = 64  # tokens a block of the chunked prompt form solves at once


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: Any, state_index: int):
        super().__init__()
        self.state_index = state_index  # this layer's index into the state tensors
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.key_dim, self.value_dim = self.key_heads * self.dk, self.value_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        hidden = cfg.hidden_size
        self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=False)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads))
        self.A_log = nn.Parameter(torch.empty(self.value_heads))
        self.norm = GatedHeadNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One unit's conv state and recurrent state in one layer."""
        return (self.kernel - 1, self.conv_dim), (self.value_heads, self.dk, self.dv)

    def forward(
        self, x: torch.Tensor, step: MambaStep, conv: torch.Tensor, state: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `conv` [units, K-1, conv_dim] and `state` [units,
        value heads, dk, dv] (this layer's) are read and written at the rows' units."""
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        counts = np.diff(step.query_start)
        o = torch.zeros(t, self.value_heads, self.dv, dtype=torch.float32, device=x.device)
        single = counts == 1
        if single.all():  # a decode step (no index copies: graph-capturable)
            n = len(counts)
            o[:n] = self._decode(mixed[:n], b[:n], a[:n], step.units, step.fresh_dev, conv, state)
        else:
            if single.any():
                rows = np.flatnonzero(single)
                at = torch.from_numpy(step.query_start[rows]).to(x.device, non_blocking=True)
                on = torch.from_numpy(rows).to(x.device, non_blocking=True)
                o[at] = self._decode(mixed[at], b[at], a[at], step.units[on],
                                     step.fresh_dev[on], conv, state)  # fmt: skip
            for r in np.flatnonzero(~single).tolist():
                first, end = int(step.query_start[r]), int(step.query_start[r + 1])
                o[first:end] = self._prompt(mixed[first:end], b[first:end], a[first:end],
                                            step, r, conv, state)  # fmt: skip
        out = self.norm(o.to(x.dtype), z).reshape(t, self.value_dim).to(x.dtype)
        return self.out_proj(out)

    # ---- parts ----------------------------------------------------------------------

    def _project(self, x: torch.Tensor):
        """-> the conv input [T, conv_dim] (q | k | v, heads in order), z [T, Hv, dv], and
        b, a [T, Hv]: the checkpoint groups each key head's q, k and its value heads' v, z
        (and b, a) together."""
        t, r = x.shape[0], self.value_heads // self.key_heads
        qkvz = self.in_proj_qkvz(x).view(t, self.key_heads, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = self.in_proj_ba(x).view(t, self.key_heads, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, self.value_heads, self.dv), b.reshape(t, -1),
                a.reshape(t, -1))  # fmt: skip

    def _conv(self, windows: torch.Tensor):
        """Windows of K conv inputs [N, C, K] -> q, k [N, Hv, dk] (normalised, q scaled,
        each key head repeated for its value heads) and v [N, Hv, dv], float32."""
        out = F.silu((windows.float() * self.conv1d.weight[:, 0, :].float()[None]).sum(-1))
        n, r = out.shape[0], self.value_heads // self.key_heads
        q, k, v = out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.reshape(n, self.key_heads, self.dk)) * self.dk**-0.5
        k = _l2norm(k.reshape(n, self.key_heads, self.dk))
        q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
        return q, k, v.reshape(n, self.value_heads, self.dv)

    def _gates(self, b: torch.Tensor, a: torch.Tensor):
        """-> beta, g [N, Hv] float32 (g <= 0: the log of the step's decay)."""
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        return torch.sigmoid(b.float()), g

    def _prompt(self, mixed, b, a, step: MambaStep, r: int, conv, state) -> torch.Tensor:
        """One row's tokens (a prompt chunk): its convolution and the blocked delta rule."""
        unit = step.units[r]
        fresh = bool(step.fresh[r])
        full = conv_row_inputs(conv, unit, fresh, mixed)  # [K-1+T, C]
        q, k, v = self._conv(full.unfold(0, self.kernel, 1))
        beta, g = self._gates(b, a)
        s0 = torch.zeros_like(state[0], dtype=torch.float32) if fresh else state[unit].float()
        o, s = delta_rule_blocks(q, k, v, beta, g, s0, CHUNK)
        state[unit] = s.to(state.dtype)
        return o

    def _decode(self, mixed, b, a, units, fresh, conv, state) -> torch.Tensor:
        """One token a row, these rows (their `units`, and which are `fresh`) at once."""
        full = conv_step_windows(conv, units, fresh, mixed)  # [R, K, C]
        q, k, v = self._conv(full.transpose(1, 2))  # [R, Hv, d]
        beta, g = self._gates(b, a)
        # kernels/delta_rule_update.py: each state read and written once on a GPU
        return delta_rule_decode(state, units, fresh, q.contiguous(), k.contiguous(),
                                 v.contiguous(), beta, g)  # fmt: skip


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_blocks(q, k, v, beta, g, s0, chunk: int):
    """The gated delta rule over one row's T tokens from state `s0`, `chunk` tokens a block
    (the module docstring's form). q, k [T, H, dk], v [T, H, dv], beta, g [T, H], s0 [H,
    dk, dv] -> (o [T, H, dv], the final state); all float32."""
    out = []
    s = s0
    for start in range(0, q.shape[0], chunk):
        qb, kb, vb = (x[start : start + chunk].transpose(0, 1) for x in (q, k, v))  # [H, L, d]
        bb, gb = beta[start : start + chunk].T, g[start : start + chunk].T  # [H, L]
        length = qb.shape[1]
        cum = torch.cumsum(gb, dim=-1)  # [H, L]
        rel = cum[:, :, None] - cum[:, None, :]  # [H, t, i]: G_t - G_i
        lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        below = lower.tril(-1)
        strict = torch.exp(rel.masked_fill(~below, float("-inf")))
        incl = torch.exp(rel.masked_fill(~lower, float("-inf")))
        system = (
            torch.eye(length, device=q.device) + bb[:, :, None] * (kb @ kb.transpose(1, 2)) * strict
        )
        decay = torch.exp(cum)[..., None]  # [H, L, 1]
        rhs = bb[..., None] * (vb - decay * (kb @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out.append((decay * (qb @ s) + ((qb @ kb.transpose(1, 2)) * incl) @ u).transpose(0, 1))
        last = cum[:, -1:]  # [H, 1]
        s = torch.exp(last)[..., None] * s + kb.transpose(1, 2) @ (
            torch.exp(last - cum)[..., None] * u
        )
    return torch.cat(out), s


class GatedHeadNorm(nn.Module):
    """RMSNorm over each value head's dv features (float32), rounded to o's dtype, times
    the weight, times silu(z) in float32 (Qwen3-Next's norm-then-gate order)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = o.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return self.weight * normed * F.silu(z.float())
