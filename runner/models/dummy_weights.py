"""vLLM's `--load-format dummy`: random weights in the checkpoint's own names and shapes,
for timing a model without fetching its weights (a folder or hub id needs config.json and
a tokenizer only).

The names and shapes come from transformers' model for the config, built on the meta
device (no memory); each tensor is drawn uniformly from [-1e-3, 1e-3], vLLM's range, on
the target device by a generator seeded with the tensor's name, so every worker of a
deployment (a PD pair's prefill and decode side) loads the same weights; a tensor tied to
another (a tied LM head) is not drawn again. They stream through the family's own
`load_weights`, so fused projections, reorders and derived buffers come out as from a
real checkpoint. The checkpoint's quantization is ignored: the weights are the model's
dtype.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator
from typing import Any

import torch

DUMMY_RANGE = 1e-3


def dummy_weights(
    hf_config: Any, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, random tensor) for every tensor of the config's model."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(hf_config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(cfg, dtype=dtype).state_dict(keep_vars=True)
    seen: set[int] = set()
    for name, meta in shapes.items():
        if id(meta) in seen:  # tied to a tensor already drawn (a tied LM head)
            continue
        seen.add(id(meta))
        out = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if out.is_floating_point():
            seed = zlib.crc32(name.encode())
            gen = torch.Generator(device=device).manual_seed(seed)
            out.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)
        else:
            out.zero_()
        yield name, out
