"""Sequence classifiers (vLLM's `LLM.classify`, `/classify`, and cross-encoder `/score` and
`/rerank`): a decoder whose last prompt token's normed hidden state goes through a
`score` head of `num_labels` rows instead of the LM head, as transformers'
`*ForSequenceClassification` computes it.

Two ways a checkpoint becomes one:
- its architecture is `LlamaForSequenceClassification`, `Qwen3ForSequenceClassification`
  (...) and it ships `score.weight`;
- a causal LM converted by its config (`--hf-overrides`, vLLM's keys): the architecture
  set to a `...ForSequenceClassification` and `classifier_from_token` naming tokens whose
  LM-head rows make the head. With two tokens and `method: "from_2_way_softmax"` (or
  `is_original_qwen3_reranker: true`, Qwen3-Reranker's conversion) the head is one row,
  `row(second) - row(first)`, whose sigmoid is the 2-way softmax's second probability
  (`P(yes)`); otherwise one label per token.

How the logits become probabilities follows the config's `problem_type`: regression keeps
them; multi-label classification takes each one's sigmoid; otherwise one label takes its
sigmoid and several their softmax. A request may ask for the raw logits
(`activation=False`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACTIVATIONS = ("none", "sigmoid", "softmax")
_SUFFIX = "ForSequenceClassification"
_TWO_WAY = "from_2_way_softmax"
_PER_TOKEN = "no_post_processing"


@dataclass(frozen=True)
class ClassifierSpec:
    num_labels: int
    activation: str  # one of ACTIVATIONS: the logits -> what a response reports
    labels: tuple[str, ...]  # id2label, one per label
    # Converted from a causal LM: the LM-head rows the head is made of (their token ids),
    # and whether the one label is row(second) - row(first).
    from_token_ids: tuple[int, ...] = ()
    two_way: bool = False

    def __post_init__(self) -> None:
        assert self.activation in ACTIVATIONS, self.activation
        assert len(self.labels) == self.num_labels >= 1


def is_classifier(hf_config: Any) -> bool:
    archs = getattr(hf_config, "architectures", None) or [""]
    return str(archs[0]).endswith(_SUFFIX)


def pooling_only(hf_config: Any) -> bool:
    """A checkpoint without an LM head: a base model (`Qwen3Model`, ...: embeddings) or a
    classifier. It pools; it does not generate."""
    archs = getattr(hf_config, "architectures", None) or [""]
    return str(archs[0]).endswith("Model") or is_classifier(hf_config)


def classifier_spec(hf_config: Any, tokenizer: Any | None) -> ClassifierSpec | None:
    """The head a classifier config describes (None: not a classifier); ValueError naming
    a conversion that cannot be made."""
    if not is_classifier(hf_config):
        return None
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        labels = _labels(hf_config, int(hf_config.num_labels))
        return ClassifierSpec(len(labels), _activation(hf_config, len(labels)), labels)
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token must be a list of tokens (got {tokens!r})")
    method = getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        method = method or _TWO_WAY
    method = method or _PER_TOKEN
    if method not in (_TWO_WAY, _PER_TOKEN):
        raise ValueError(f"classifier_from_token: method must be {_TWO_WAY} or {_PER_TOKEN} "
                         f"(got {method!r})")  # fmt: skip
    if method == _TWO_WAY and len(tokens) != 2:
        raise ValueError(f"{_TWO_WAY} needs two tokens, [negative, positive] (got {tokens})")
    if tokenizer is None:
        raise ValueError("classifier_from_token needs the model's tokenizer to find its tokens")
    ids = tuple(_token_id(tokenizer, t) for t in tokens)
    two_way = method == _TWO_WAY
    labels = (tokens[1],) if two_way else tuple(tokens)
    return ClassifierSpec(len(labels), _activation(hf_config, len(labels)), labels, ids, two_way)


def _token_id(tokenizer: Any, token: str) -> int:
    """The id of a token that is one vocabulary entry (as written, or as its text
    encodes to one id)."""
    tid = tokenizer.convert_tokens_to_ids(token)
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(tid, int) and tid != unk:
        return tid
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"classifier_from_token: {token!r} is not one token (ids {ids})")
    return int(ids[0])


def _labels(hf_config: Any, n: int) -> tuple[str, ...]:
    id2label = getattr(hf_config, "id2label", None) or {}
    return tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n))


def _activation(hf_config: Any, num_labels: int) -> str:
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"
