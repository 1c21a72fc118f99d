"""Arcee's AFM (`ArceeForCausalLM`, AFM-4.5B) on the paged KV cache: a Llama whose MLP has
no gate, down(relu(up(x))^2) (NemotronH's `ReluSquaredMLP`), and YaRN RoPE (rope.py reads
it). The checkpoint's `mlp.up_proj` is renamed to the MLP's `up` at load, as llama.py's
loader fuses every `up_proj` with a gate."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pdserve.runner.models.llama import LlamaFamilyForCausalLM
from pdserve.runner.models.nemotron_mlp import ReluSquaredMLP


class ArceeForCausalLM(LlamaFamilyForCausalLM):
    def _feed_forward(self, cfg: Any, layer: int) -> nn.Module:
        bias = bool(getattr(cfg, "mlp_bias", False))
        return ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, bias, self.workspace)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(".mlp.up_proj.", ".mlp.up."), tensor
