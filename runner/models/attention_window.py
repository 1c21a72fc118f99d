"""Which layers attend through a sliding window, and how wide: transformers' rule, read
from the config so the runner attends exactly as the reference model does. Llama 4's
"chunked_attention" layers attend within blocks of `attention_chunk_size` positions: their
window is that size, negated (kernels/attention.py's convention).

A config with `layer_types` (Qwen2/3, Qwen2-MoE, Gemma 2/3, ...) names each layer
"sliding_attention" or "full_attention"; the sliding ones see `sliding_window` keys. A
config without it windows every layer when its family's transformers model does
(Mistral, Mixtral, Phi-3, Qwen3-MoE). Qwen configs carry a `sliding_window` beside
`use_sliding_window: false`: the switch decides. Llama, Granite, GLM-4-MoE and DeepSeek ignore a
`sliding_window` entry, so it is ignored here too.
"""

from __future__ import annotations

from typing import Any

# Families whose transformers attention passes `config.sliding_window` to every layer.
WINDOW_ON_EVERY_LAYER = frozenset({"mistral", "ministral3", "mixtral", "phi3", "qwen3_moe"})


def sliding_window_of(hf_config: Any, layer: int) -> int:
    """Keys layer `layer`'s queries see (query p: keys p - window + 1..p); 0 = all; < 0:
    chunked attention (query p: keys from p - p % -window to p)."""
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    if getattr(hf_config, "use_sliding_window", True) is False:  # Qwen's switch
        return 0
    types = getattr(hf_config, "layer_types", None)
    if types and types[layer] == "chunked_attention":
        return -int(hf_config.attention_chunk_size)
    if types:
        return window if types[layer] == "sliding_attention" else 0
    if getattr(hf_config, "model_type", "") in WINDOW_ON_EVERY_LAYER:
        return window
    return 0


def windowed_layers(hf_config: Any) -> list[int]:
    """The window of each layer, in order (0 for full attention)."""
    return [sliding_window_of(hf_config, i) for i in range(hf_config.num_hidden_layers)]
