"""A servable random model: throughput.py's Qwen3-0.6B-shaped random bf16 weights plus a
word-level tokenizer over the whole vocabulary (token i is the word `t<i>`), so that
`pdserve serve`, whose HTTP API needs a tokenizer, can run it. The benchmarks send token
ids, so the tokenizer only names what comes back. Not a test.

    python benchmarks/synthetic_model.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_word_tokenizer(path: Path, vocab_size: int, eos_token_id: int | None) -> None:
    """tokenizer.json + tokenizer_config.json: ids 0..vocab_size-1 as words t0, t1, ...,
    split on whitespace, decoded joined by spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}
    if eos_token_id is not None:
        config["eos_token"] = f"t{eos_token_id}"
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def build_servable_model(path: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import build_model_dir, qwen3_06b_config

    build_model_dir(path)
    cfg = qwen3_06b_config()
    write_word_tokenizer(path, cfg.vocab_size, cfg.eos_token_id)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(build_servable_model(Path(sys.argv[1])))
