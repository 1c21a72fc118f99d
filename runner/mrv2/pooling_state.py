"""Per-slot pooling for embedding requests (runner/pooling.py): which slots pool and how,
and the running fp32 sums of mean pooling, across the steps of a chunked prompt.

`collect` runs after an eager forward: a mean row adds its chunk's normed hidden states,
a CLS row keeps its first position's; a row whose prompt this step completed gives its
vector (normalised when asked). Steps with pooling rows never run as decode graphs."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.runner.pooling import POOLING_METHODS, PoolingSpec

_NONE = 0
_CODE = {m: i + 1 for i, m in enumerate(POOLING_METHODS)}  # last 1, mean 2, cls 3


class PoolingState:
    def __init__(self, max_reqs: int, hidden_size: int, device: torch.device):
        self.method = np.zeros(max_reqs, dtype=np.int8)
        self.normalize = np.zeros(max_reqs, dtype=bool)
        self.hidden_size, self.device = hidden_size, device
        self._acc: torch.Tensor | None = None  # [max_reqs, hidden] fp32, made on first use

    def add(self, slot: int, spec: PoolingSpec | None) -> None:
        self.method[slot] = _NONE if spec is None else _CODE[spec.method]
        self.normalize[slot] = spec is not None and spec.normalize

    def any(self, slots: np.ndarray) -> bool:
        return bool(self.method[slots].any())

    def collect(
        self,
        norm,  # the model's final norm
        hidden: torch.Tensor,
        slots: np.ndarray,
        query_start: np.ndarray,  # [R + 1] host copy of the step's query_start_loc
        num_computed: np.ndarray,
        done: np.ndarray,  # [R] bool: the row's prompt is complete after this step
    ) -> list[tuple[int, torch.Tensor]]:
        """(row, pooled vector [hidden] fp32) for each row whose prompt completed."""
        out = []
        for row in np.nonzero(self.method[slots])[0]:
            slot, method = int(slots[row]), int(self.method[slots[row]])
            first, end = int(query_start[row]), int(query_start[row + 1])
            if method == _CODE["mean"]:
                part = norm(hidden[first:end]).float().sum(0)
                acc = self._sums()
                acc[slot] = part if num_computed[row] == 0 else acc[slot] + part
            elif method == _CODE["cls"] and num_computed[row] == 0:
                self._sums()[slot] = norm(hidden[first : first + 1]).float()[0]
            if not done[row]:
                continue
            if method == _CODE["last"]:
                vec = norm(hidden[end - 1 : end]).float()[0]
            elif method == _CODE["mean"]:
                vec = self._sums()[slot] / float(num_computed[row] + end - first)
            else:
                vec = self._sums()[slot].clone()
            out.append((int(row), F.normalize(vec, dim=0) if self.normalize[slot] else vec))
        return out

    def _sums(self) -> torch.Tensor:
        if self._acc is None:
            rows = len(self.method)
            self._acc = torch.zeros(rows, self.hidden_size, dtype=torch.float32, device=self.device)
        return self._acc
