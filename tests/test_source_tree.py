"""The checkout's top-level `kernels/` must not shadow the `kernels` distribution that
transformers >= 5.25 imports: importing pdserve takes the repository root off sys.path
(pdserve/source_tree.py). Checked in fresh interpreters started in the root, as
`python -m` / `python -c` from a checkout are."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.source_tree import ROOT, is_checkout, without_root

FIND = (
    "import importlib.util, json, sys; s = importlib.util.find_spec('kernels'); "
    "print(json.dumps([s.origin if s else None, '' in sys.path]))"
)


def _run(code: str) -> list:
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_pdserve_unshadows_kernels():
    # Without pdserve, the root's kernels/ is what `import kernels` finds: the hazard.
    origin, on_path = _run(FIND)
    assert on_path and origin == str(ROOT / "kernels" / "__init__.py")
    # After `import pdserve`: the root is gone from sys.path and kernels/ is not found.
    origin, on_path = _run("import pdserve; " + FIND)
    assert not on_path and (origin is None or not origin.startswith(str(ROOT / "kernels")))
    # A kernels module already imported from the root is forgotten.
    origin, _ = _run("import kernels; import pdserve; " + FIND)
    assert origin is None or not origin.startswith(str(ROOT / "kernels"))


def test_only_the_root_entries_go(monkeypatch, tmp_path):
    assert is_checkout() and not is_checkout(tmp_path)
    monkeypatch.chdir(ROOT)  # '' is the working directory: here, the root
    path = ["", str(ROOT), "/elsewhere", str(ROOT / "tests")]
    assert without_root(path, ROOT) == ["/elsewhere", str(ROOT / "tests")]
    monkeypatch.chdir(tmp_path)
    assert without_root(path, ROOT) == ["", "/elsewhere", str(ROOT / "tests")]
