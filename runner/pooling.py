"""Pooling requests (vLLM's `LLM.embed` / `/v1/embeddings` and `LLM.classify` /
`/classify`): a prompt's final hidden states, after the model's last norm, pooled into
one vector: an embedding, or a classifier's label logits (runner/classify.py).

How a model pools is its checkpoint's: a Sentence-Transformers folder says it in
`modules.json` and its Pooling module's `config.json` (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, `pooling_mode_cls_token`), and a `Normalize` module makes the
vector unit-length; a plain checkpoint pools its last token and normalises (vLLM's default
for decoder embedding models). A classifier pools its last token through its score head.

A request may turn normalising off and, on a Matryoshka model (`is_matryoshka` or
`matryoshka_dimensions` in its config, or set by `--hf-overrides`), keep the first
`dimensions` features (before normalising, as such models are trained); a classification
request may ask for raw logits (`activation=False`). vLLM's rule: each task takes only its
own parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.runner.classify import ACTIVATIONS, ClassifierSpec, pooling_only

POOLING_METHODS = ("last", "mean", "cls")
POOLING_TASKS = ("embed", "classify")
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's: per request. None: the model's choice. `normalize` and `dimensions` are an
    embedding's; `activation` a classification's."""

    normalize: bool | None = None
    dimensions: int | None = None  # Matryoshka: keep the first `dimensions` features
    activation: bool | None = None  # False: a classifier's raw logits

    def __post_init__(self) -> None:
        for key in ("normalize", "activation"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{key} must be true, false or null (got {value!r})")
        dims = self.dimensions
        if dims is not None and (type(dims) is not int or dims < 1):
            raise ValueError(f"dimensions must be an integer >= 1 (got {dims!r})")

    def check_task(self, task: str) -> None:
        """vLLM's rule: a task takes only its own parameters (ValueError naming the rest)."""
        keys = _TASK_KEYS[task]
        stray = [k for k in ("normalize", "dimensions", "activation")
                 if getattr(self, k) is not None and k not in keys]  # fmt: skip
        if stray:
            raise ValueError(f"{task} requests take {list(keys)}, not {stray}")


_TASK_KEYS = {"embed": ("normalize", "dimensions"), "classify": ("activation",)}
_WIRE_KEYS = {"task", "normalize", "dimensions", "activation"}


def pooling_to_wire(task: str, params: PoolingParams | None) -> dict:
    """A pooling request's part of a work request (cluster/wire.py)."""
    assert task in POOLING_TASKS, task
    p = params or PoolingParams()
    return {"task": task, "normalize": p.normalize, "dimensions": p.dimensions,
            "activation": p.activation}  # fmt: skip


def pooling_from_wire(body: Any) -> tuple[str, PoolingParams]:
    """`pooling_to_wire`'s inverse; ValueError for anything else."""
    if not (isinstance(body, dict) and set(body) == _WIRE_KEYS):
        raise ValueError(f"a pooling request is a map of {sorted(_WIRE_KEYS)}")
    if body["task"] not in POOLING_TASKS:
        raise ValueError(f"pooling task must be one of {POOLING_TASKS} (got {body['task']!r})")
    params = PoolingParams(body["normalize"], body["dimensions"], body["activation"])
    return body["task"], params


@dataclass(frozen=True)
class PoolingSpec:
    """How one request's prompt is pooled."""

    method: str  # one of POOLING_METHODS
    normalize: bool
    dimensions: int | None = None  # keep the first this many features (then normalise)
    activation: str = "none"  # a classifier's logits -> probabilities (runner/classify.py)
    classify: bool = False  # through the model's score head

    def __post_init__(self) -> None:
        assert self.method in POOLING_METHODS, self.method
        assert self.activation in ACTIVATIONS, self.activation

    @property
    def every_position(self) -> bool:
        """It reads every prompt position's hidden state: no prefix-cache hits."""
        return self.method != "last"


@dataclass(frozen=True)
class ModelPooling:
    """What a model's pooling requests may be: its task, its default spec, Matryoshka
    truncation (None: not a Matryoshka model; () any width up to `hidden_size`)."""

    task: str  # one of POOLING_TASKS
    default: PoolingSpec
    hidden_size: int
    matryoshka: tuple[int, ...] | None = None
    classifier: ClassifierSpec | None = None
    generates: bool = True  # it has an LM head (a base-model or classifier checkpoint: not)

    def serves(self) -> str:
        """What it serves besides generating, in words for an error."""
        if self.task == "classify":
            return "classify, score and rerank (LLM.classify, /classify)"
        return "embeddings (LLM.embed, /v1/embeddings)"

    def for_request(self, params: PoolingParams | None, task: str) -> PoolingSpec:
        """The spec of one request of `task`; ValueError naming what the model or the task
        does not take."""
        assert task in POOLING_TASKS, task
        if task != self.task:
            kind = "a classifier" if self.task == "classify" else "not a classifier"
            raise ValueError(f"this model is {kind}: it serves {self.serves()}, not {task}")
        params = params or PoolingParams()
        params.check_task(task)
        spec = self.default
        if params.normalize is not None:
            spec = replace(spec, normalize=params.normalize)
        if params.activation is False:
            spec = replace(spec, activation="none")
        if params.dimensions is not None:
            spec = replace(spec, dimensions=self._dimensions(params.dimensions))
        return spec

    def _dimensions(self, dims: int) -> int:
        if self.matryoshka is None:
            raise ValueError(
                "dimensions: this model is not a Matryoshka model (its config sets neither "
                "is_matryoshka nor matryoshka_dimensions; --hf-overrides can)"
            )
        if self.matryoshka and dims not in self.matryoshka:
            raise ValueError(f"dimensions: this model takes {list(self.matryoshka)} (got {dims})")
        if dims > self.hidden_size:
            raise ValueError(f"dimensions: at most the model's {self.hidden_size} (got {dims})")
        return dims


def model_pooling(
    model_dir: str | Path, hf_config: Any, classifier: ClassifierSpec | None
) -> ModelPooling:
    """The model's pooling: a classifier's head, else its embedding pooling."""
    hidden = int(hf_config.hidden_size)
    if classifier is not None:
        spec = PoolingSpec("last", False, activation=classifier.activation, classify=True)
        return ModelPooling("classify", spec, hidden, classifier=classifier, generates=False)
    return ModelPooling("embed", _embedding_spec(model_dir), hidden, _matryoshka(hf_config),
                        generates=not pooling_only(hf_config))  # fmt: skip


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        if not (isinstance(dims, list | tuple) and all(type(d) is int and d > 0 for d in dims)):
            raise ValueError(f"matryoshka_dimensions must be positive integers (got {dims!r})")
        return tuple(dims)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def _embedding_spec(model_dir: str | Path) -> PoolingSpec:
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
