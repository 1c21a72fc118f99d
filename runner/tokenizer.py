"""Tokenizer loading and the set of end-of-sequence ids a model uses."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Any | None:
    """The directory's tokenizer, or None when it ships none (random-weight test models).
    `trust_remote_code`: a tokenizer class the checkpoint ships may run (vLLM's flag)."""
    path = Path(model_dir)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        logger.info("no tokenizer in %s: outputs carry token ids only", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def eos_token_ids(model_dir: str | Path, hf_config: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """Union of the EOS ids in generation_config.json, config.json and the tokenizer."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if int(v) not in ids:
                ids.append(int(v))

    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)
