"""vLLM's `hf_overrides` (`--hf-overrides JSON`): keys set on the checkpoint's transformers
config before anything reads it, e.g. `{"is_matryoshka": true}` for an embedding model
whose config does not say so, or Qwen3-Reranker's conversion into a classifier
(`{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no",
"yes"]}`, runner/classify.py).

A value that is a JSON object and lands on a sub-config (e.g. `text_config`) is merged into
it key by key; any other value replaces the key's. Every worker resolves the same
overrides from its engine arguments, so P, D and the router see one config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.json_arg import json_object


def parse_hf_overrides(value: str | Mapping | None) -> dict:
    """`--hf-overrides`: a JSON object (a mapping from a config file or `LLM(...)`)."""
    data = json_object("--hf-overrides", value)
    bad = [k for k in data if not isinstance(k, str) or not k or k.startswith("_")]
    if bad:
        raise ValueError(f"--hf-overrides: {bad[0]!r} is not a config key")
    return data


def apply_hf_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """`config` (a transformers PretrainedConfig) with `overrides` set in place; returned."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, Mapping) and hasattr(current, "to_dict"):  # a sub-config
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)
    return config
