"""Per-slot pooling for embedding requests (runner/pooling.py): which slots pool and how,
and the running fp32 sums of mean pooling, across the steps of a chunked prompt.

`collect` runs after an eager forward: a mean row adds its chunk's normed hidden states,
a CLS row keeps its first position's; a row whose prompt this step completed gives its
vector: a classifier's through its score head (then its activation), an embedding's cut
to its Matryoshka width and normalised when asked. Steps with pooling rows never run as
decode graphs."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.runner.classify import ACTIVATIONS
from pdserve.runner.pooling import POOLING_METHODS, PoolingSpec

_NONE = 0
_CODE = {m: i + 1 for i, m in enumerate(POOLING_METHODS)}  # last 1, mean 2, cls 3
_ACT = {a: i for i, a in enumerate(ACTIVATIONS)}


class PoolingState:
    def __init__(self, max_reqs: int, hidden_size: int, device: torch.device):
        self.method = np.zeros(max_reqs, dtype=np.int8)
        self.normalize = np.zeros(max_reqs, dtype=bool)
        self.dimensions = np.zeros(max_reqs, dtype=np.int32)  # 0: all of them
        self.activation = np.zeros(max_reqs, dtype=np.int8)  # an ACTIVATIONS index
        self.classify = np.zeros(max_reqs, dtype=bool)
        self.hidden_size, self.device = hidden_size, device
        self._acc: torch.Tensor | None = None  # [max_reqs, hidden] fp32, made on first use

    def add(self, slot: int, spec: PoolingSpec | None) -> None:
        self.method[slot] = _NONE if spec is None else _CODE[spec.method]
        self.normalize[slot] = spec is not None and spec.normalize
        self.dimensions[slot] = (spec.dimensions or 0) if spec is not None else 0
        self.activation[slot] = _ACT[spec.activation] if spec is not None else 0
        self.classify[slot] = spec is not None and spec.classify

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
        head: torch.nn.Module | None = None,  # a classifier's score head
    ) -> list[tuple[int, torch.Tensor]]:
        """(row, pooled vector fp32) for each row whose prompt completed: [hidden] (or its
        Matryoshka width) for an embedding, [num_labels] for a classification."""
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
            out.append((int(row), self._finish(slot, vec, head)))
        return out

    def _finish(self, slot: int, vec: torch.Tensor, head: torch.nn.Module | None) -> torch.Tensor:
        if self.classify[slot]:
            assert head is not None, "a classification request on a model without a score head"
            # the head in the model's dtype, as transformers' score layer runs
            logits = head(vec.to(head.weight.dtype)[None])[0].float()
            act = ACTIVATIONS[self.activation[slot]]
            if act == "sigmoid":
                return torch.sigmoid(logits)
            return torch.softmax(logits, 0) if act == "softmax" else logits
        if self.dimensions[slot]:
            vec = vec[: int(self.dimensions[slot])]
        return F.normalize(vec, dim=0) if self.normalize[slot] else vec

    def _sums(self) -> torch.Tensor:
        if self._acc is None:
            rows = len(self.method)
            self._acc = torch.zeros(rows, self.hidden_size, dtype=torch.float32, device=self.device)
        return self._acc
