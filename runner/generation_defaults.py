"""Server-wide sampling defaults, as vLLM's `--generation-config` and
`--override-generation-config` make them.

A request field that is absent (or null) takes the server's default, and only then the
OpenAI default. The server's defaults come from the model's `generation_config.json`
(`auto`, the default), from another folder's (a path), or from nowhere (`vllm`), and
the override's keys are laid over them. From the file, as vLLM reads it (through
transformers 5, whose `GenerationConfig` leaves every field unset by default): the
temperature, top_p, top_k, min_p and repetition_penalty it sets, and `max_new_tokens`,
which becomes `max_tokens`: a cap on every request's output, explicit ones included.
`do_sample: false` does not make requests greedy (vLLM ignores it too).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from pdserve.json_arg import json_object

# What a default may set, in the generation config's words (the override's too).
KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def parse_override(text: str | Mapping | None) -> dict:
    """`--override-generation-config`: a JSON object (a mapping from a config file)."""
    return json_object("--override-generation-config", text)


def from_file(folder: Path) -> dict:
    """The sampling keys a folder's generation_config.json sets."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return {k: data[k] for k in KEYS if data.get(k) is not None}


def sampling_defaults(source: str, model_dir: Path, override: Mapping) -> dict:
    """The server's defaults, keyed as requests' fields (max_new_tokens as max_tokens):
    `source` is auto (the model's folder), vllm (none) or a folder; `override`'s keys win.
    Raises ValueError naming a bad key or value (vLLM drops unknown override keys)."""
    if source == "auto":
        base = from_file(model_dir)
    elif source == "vllm":
        base = {}
    else:
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--generation-config {source!r} is not auto, vllm or a folder")
        base = from_file(folder)
    out = {**base, **override}
    unknown = sorted(set(out) - set(KEYS))
    if unknown:
        raise ValueError(
            f"generation config keys {unknown} are not sampling defaults; known: {list(KEYS)}"
        )
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    _check(out)
    return out


def _check(d: Mapping) -> None:
    from pdserve.runner.sampling_params import SamplingParams

    for key, v in d.items():
        if not _number(v):
            raise ValueError(f"generation config {key} must be a number, got {v!r}")
    cap = d.get("max_tokens")
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise ValueError(f"generation config max_new_tokens must be an integer >= 1, got {cap!r}")
    try:
        SamplingParams(max_tokens=1, **{k: v for k, v in d.items() if k != "max_tokens"})
    except ValueError as e:
        raise ValueError(f"generation config: {e}") from e


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
