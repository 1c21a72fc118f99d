"""What every benchmark row records about where it ran: the commit and the device."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch


def git_commit() -> str:
    """PDSERVE_COMMIT when set (a device copy's .git may lag the tree), else git's HEAD."""
    if os.environ.get("PDSERVE_COMMIT"):
        return os.environ["PDSERVE_COMMIT"]
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], text=True, cwd=Path(__file__).parent
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_kind() -> str:
    """`cpu`, or the GPU's name as a file-name slug (`nvidia-h200`), with `-x<N>` for N > 1
    GPUs (`nvidia-h200-x2`, as the device tool names its machines)."""
    if not torch.cuda.is_available():
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    n = torch.cuda.device_count()
    return slug if n == 1 else f"{slug}-x{n}"


def write_result(out_dir: str, stem: str, script: str, argv: list[str], fields: dict) -> Path:
    """`<out_dir>/<stem>_<device kind>.json`: `fields` with the device, commit and command
    that produced them; the path goes to stderr."""
    out = {
        **fields,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": git_commit(),
        "command": " ".join([script, *argv]),
    }
    path = Path(out_dir) / f"{stem}_{device_kind()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return path
