"""Which gate an MoE layer's experts apply (kernels/moe.py and its Triton path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertAct:
    """The experts' gate: "silu" (SwiGLU: silu(gate) * up), "swiglu_oai" (gpt-oss: gate
    clamped above at `limit`, up to +-`limit`, then (up + 1) * gate * sigmoid(alpha * gate)),
    or "relu2" (NemotronH: no gate, relu(up)^2; the gate/up weights are up alone,
    `[E, I, H]`)."""

    kind: str = "silu"
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        assert self.kind in ("silu", "swiglu_oai", "relu2"), (
            f"unknown expert activation {self.kind!r}"
        )

    @property
    def gated(self) -> bool:
        """The first projection holds gate and up rows ([E, 2I, H]), not up alone."""
        return self.kind != "relu2"


SILU = ExpertAct()
RELU2 = ExpertAct("relu2")
