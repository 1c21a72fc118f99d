"""Running from a source checkout: keep the repository root off `sys.path`.

The repository's top-level `kernels/` (installed as `pdserve.kernels`) has the import name
of the `kernels` distribution that transformers >= 5.25 requires and imports at load. When
the root is on `sys.path` (`python -m ...` or `python -c` started in it put the working
directory there), `import kernels` finds our directory and transformers fails with
"cannot import name 'CUDAProperties' from 'kernels'". pdserve itself never imports from
the root by path (the editable install maps its packages), so importing pdserve takes the
root off `sys.path`, and forgets a `kernels` module already imported from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def is_checkout(root: Path = ROOT) -> bool:
    """A source tree (not site-packages, where a `kernels/` is the real distribution)."""
    return (root / "kernels" / "skinny_linear.py").is_file() and (root / "pyproject.toml").is_file()


def without_root(path: list[str], root: Path = ROOT) -> list[str]:
    """`path` without the entries that name `root` ('' is the working directory)."""
    return [p for p in path if Path(os.path.abspath(p or os.curdir)) != root]


def keep_root_off_path() -> None:
    if not is_checkout():
        return
    sys.path[:] = without_root(sys.path)
    shadow = sys.modules.get("kernels")
    origin = getattr(shadow, "__file__", None) or ""
    if origin and Path(origin).resolve().is_relative_to(ROOT / "kernels"):
        del sys.modules["kernels"]
