"""A flag whose value is a JSON object (`--hf-overrides`, `--override-generation-config`,
`--limit-mm-per-prompt`), given as JSON text on the command line or as a mapping from a
config file or `LLM(...)`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_object(flag: str, value: str | Mapping | None) -> dict:
    """`value` as a dict ({} for None); a ValueError naming `flag` for bad JSON or a JSON
    value that is not an object."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        data: Any = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{flag} must be a JSON object (got {type(data).__name__})")
    return data
