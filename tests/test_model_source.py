"""The GGUF conversion cache is keyed by the file's content, not its path or mtime."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pdserve.runner.model_source import (
    BUNDLED_GGUF,
    bundled_gguf_path,
    cache_dir,
    content_key,
    convert_gguf,
)


def test_content_key_follows_bytes_not_path_or_mtime(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "sub" / "a.gguf", tmp_path / "c.gguf"
    b.parent.mkdir()
    a.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    shutil.copyfile(a, b)
    os.utime(b, (1_000_000, 1_000_000))
    c.write_bytes(a.read_bytes()[:-1] + b"\x00")
    assert content_key(a) == content_key(b) != content_key(c)


def test_the_bundled_gguf_at_another_path_reuses_its_conversion(smollm_dir, tmp_path):
    """A reinstall (a new venv: new path, new mtime) must not write another 0.5 GB copy."""
    copy = tmp_path / BUNDLED_GGUF
    shutil.copyfile(bundled_gguf_path(), copy)
    os.utime(copy, (1_000_000, 1_000_000))
    before = sorted(p.name for p in (cache_dir() / "models").iterdir())
    assert convert_gguf(copy) == Path(smollm_dir)
    assert sorted(p.name for p in (cache_dir() / "models").iterdir()) == before
