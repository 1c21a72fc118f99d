"""Hybrid Mamba models (Bamba, Granite 4.0-H, NemotronH: runner/models/mamba_hybrid.py):
what their path switches off.

A Mamba layer's output depends on its request's whole history through the state in the
request's slot (runner/mrv2/mamba_state.py), not on paged KV blocks. So:
- prefix caching is off: a cached block would need the Mamba state at its end, which is
  not kept;
- PD and the KV tier are refused: they move paged KV blocks, and the Mamba state does not
  travel with them (the `mamba_state` layout of kvtransfer/ is not wired to this model);
- CUDA graphs are off: the mixer runs in torch, eagerly (runner/models/mamba2.py).
Each is logged or refused by name, so the path an operator sees is the one that runs.
"""

from __future__ import annotations

from typing import Any

from pdserve.runner.models.mamba_hybrid import mamba_layers

WHY = "a hybrid Mamba model's state does not travel with its KV blocks"


def is_hybrid(hf_config: Any) -> bool:
    return bool(mamba_layers(hf_config))
