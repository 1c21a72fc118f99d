"""A checkpoint's FP8 KV-cache scales, taken out of its tensors and set on the attention
modules (kernels/fp8_kv.py says what they scale).

Names read, as vLLM reads them: `<attention>.k_scale` / `.v_scale` (llm-compressor and
ModelOpt exports), `<attention>.kv_scale` (older FP8 exports: one scale for both), and
`<attention>.k_proj.output_scale` / `.v_proj.output_scale` (compressed-tensors). Each is
one float per layer; a scale per head is refused by name. A model served with a cache
in its own dtype ignores them (vLLM does too).

What this module does not know: whether the cache will be FP8 (the attention module
checks its cache's dtype at each call).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

# checkpoint suffix -> which of the module's scales it sets
_SUFFIXES = {
    ".k_scale": ("k_scale",),
    ".v_scale": ("v_scale",),
    ".kv_scale": ("k_scale", "v_scale"),
    ".k_proj.output_scale": ("k_scale",),
    ".v_proj.output_scale": ("v_scale",),
}


class KvScales:
    """Collects the scales from a weight stream (`take`), then sets them (`apply`)."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, float]] = {}  # module path -> {attr: value}

    def take(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream without its KV-cache scales, which are kept here."""
        for name, tensor in weights:
            suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                yield name, tensor
                continue
            if tensor.numel() != 1:
                raise ValueError(
                    f"{name}: a KV-cache scale per layer is one number, got shape "
                    f"{list(tensor.shape)} (per-head scales are not supported)"
                )
            value = float(tensor.float().reshape(()))
            if not value > 0:
                raise ValueError(f"{name}: a KV-cache scale must be positive, got {value}")
            for attr in _SUFFIXES[suffix]:
                self.found.setdefault(name[: -len(suffix)], {})[attr] = value

    def apply(self, model: nn.Module) -> None:
        """Set each scale on its attention module: the checkpoint's path after the model
        family's renames (`_RENAMES`, e.g. NemotronH's `backbone.`), without "model."."""
        for checkpoint_path, values in self.found.items():
            path = checkpoint_path + "."
            for theirs, ours in getattr(model, "_RENAMES", ()):
                path = path.replace(theirs, ours)
            path = path.removesuffix(".").removeprefix("model.")
            try:
                module = model.get_submodule(path)
            except AttributeError:
                module = None
            if module is None or not all(hasattr(module, a) for a in values):
                raise ValueError(
                    f"checkpoint KV-cache scale for {path!r}: no attention module there in "
                    f"{type(model).__name__}"
                )
            for attr, value in values.items():
                setattr(module, attr, value)
