"""Which gate an MoE layer's experts apply (kernels/moe.py and its Triton path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertAct:
    """The experts' gate: "silu" (SwiGLU: silu(gate) * up) or "swiglu_oai" (gpt-oss: gate
    clamped above at `limit`, up to +-`limit`, then (up + 1) * gate * sigmoid(alpha * gate))."""

    kind: str = "silu"
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        assert self.kind in ("silu", "swiglu_oai"), f"unknown expert activation {self.kind!r}"


SILU = ExpertAct()
