"""Embeddings (vLLM's `LLM.embed`, `/v1/embeddings`): a prompt's final hidden states,
after the model's last norm, pooled into one vector.

How a model pools is its checkpoint's: a Sentence-Transformers folder says it in
`modules.json` and its Pooling module's `config.json` (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`), and a `Normalize` module makes the
vector unit-length; a plain checkpoint pools its last token and normalises (vLLM's default
for decoder embedding models). A request may turn normalising off (`PoolingParams`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_METHODS = ("last", "mean", "cls")
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's: per request. `normalize` None: the model's choice."""

    normalize: bool | None = None
    dimensions: int | None = None  # Matryoshka truncation: refused (no model declares it)

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or null (got {self.normalize!r})")
        if self.dimensions is not None:
            raise ValueError("dimensions (Matryoshka embeddings) is not supported")


@dataclass(frozen=True)
class PoolingSpec:
    """How one request's prompt is pooled."""

    method: str  # one of POOLING_METHODS
    normalize: bool

    def __post_init__(self) -> None:
        assert self.method in POOLING_METHODS, self.method

    @property
    def every_position(self) -> bool:
        """It reads every prompt position's hidden state: no prefix-cache hits."""
        return self.method != "last"

    def for_request(self, params: PoolingParams | None) -> PoolingSpec:
        if params is None or params.normalize is None:
            return self
        return PoolingSpec(self.method, params.normalize)


def model_pooling(model_dir: str | Path) -> PoolingSpec:
    """The checkpoint's pooling (Sentence-Transformers files), else last token, normalised."""
    folder = Path(model_dir)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingSpec("last", True)
    modules = json.loads(modules_file.read_text())
    method, normalize = "last", False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            config = json.loads((folder / module.get("path", "") / "config.json").read_text())
            chosen = [m for key, m in _ST_MODES.items() if config.get(key)]
            others = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
            if len(chosen) != 1 or len(others) != 1:
                raise ValueError(
                    f"{folder}: pooling modes {others} (supported: exactly one of "
                    f"{sorted(_ST_MODES)})"
                )
            method = chosen[0]
    return PoolingSpec(method, normalize)
