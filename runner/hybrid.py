"""Hybrid Mamba models (Bamba, Granite 4.0-H, NemotronH, Jamba: runner/models/mamba_hybrid.py;
Qwen3-Next's Gated DeltaNet layers the same way: runner/models/qwen3_next.py): what their
path switches off.

A Mamba layer's output depends on its request's whole history through the state in the
request's state unit (runner/state_pool.py, runner/mrv2/mamba_state.py), which exists only
at the end of what the request computed so far, not at every block boundary. So:
- prefix caching reaches only block boundaries where a state was saved: each prompt's
  last one, and a reply's last save point, every 64 tokens (runner/state_snapshots.py),
  so a chat's next turn starts near the end of the last turn's reply;
- the KV tier is off: it keeps blocks by prefix hash, without states;
- the router counts a worker's remembered prefix only as far as the last block after which
  it saved a state (cluster/prefix_index.py's state points);
- layer-wise early tickets are refused: the state is final only after the whole forward.
Decode steps take the CUDA graphs as other models' do: the mixers' one-token step reads
and writes the rows' state units (Triton state updates on CUDA), which come from
persistent buffers (pad rows on a scratch unit: runner/mrv2/mamba_state.py); prompt steps
run eagerly.
PD itself works: a held prompt keeps its unit with its blocks, and the ticket moves the
unit's final state with them (kvtransfer/ `mamba_state`), all or nothing.
Each is logged or refused by name, so the path an operator sees is the one that runs.
"""

from __future__ import annotations

from typing import Any

from pdserve.runner.models.mamba_hybrid import mamba_layers

WHY = (
    "a hybrid Mamba model's state exists only at the end of a prompt, not for each block "
    "(runner/hybrid.py)"
)


def is_hybrid(hf_config: Any) -> bool:
    return bool(mamba_layers(hf_config))
