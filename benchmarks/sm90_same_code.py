"""Do two trees compile the Triton kernels to the same sm_90 instructions? Not a test, and
no GPU: each tree's launchers run sm90_compile_check.py's scenarios on CPU tensors, every
launch caught is compiled for sm_90 with the Triton here, and the PTX of the two trees is
compared launch by launch (the n-th launch of a kernel in a scenario against its n-th in
the other tree), with comments, line markers, inlining labels and debug sections left out.

    [PYTHONPATH=<triton 3.6 dir>] python benchmarks/sm90_same_code.py --base <commit> [--only S]

Why: device time is scarce, and a refactor of a kernel that was timed on the H200 (a helper
factored out, a new constexpr branch that is off by default) needs no A/B run when it
compiles to the same instructions. "same" is that proof; otherwise the row counts the
instruction lines that differ and says whether they are the same instructions reordered,
and only a device run says what that costs. The scenarios are this
tree's (a base tree need not have them); launches the base's launchers do not make are
listed as such. Prints a JSON line a launch and exits 1 if any differs or fails.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# what a line must not run to be dropped: source line markers, inlining labels (their only
# references are in the debug sections), a debug section's data and brackets alone
SKIP = re.compile(r"(\.loc\s|\.file\s|\$L__tmp\d+:$|\.b(8|16|32|64)\s|\.section\s|[{}]$)")


def instructions(ptx: str) -> list[str]:
    """A kernel's PTX without what does not run: comments, source line markers, inlining
    labels, debug sections."""
    lines = (line.split("//")[0].strip() for line in ptx.splitlines())
    return [line for line in lines if line and not SKIP.match(line)]


def dump(only: str | None, out: str) -> None:
    """In the tree on PYTHONPATH: every scenario's launches compiled, their instructions
    written to `out` as JSON {scenario/kernel#n: [lines] or {"error": ...}}."""
    sys.path.insert(0, str(HERE))
    import sm90_compile_check as check

    result: dict[str, object] = {}
    for name, run in check.scenarios().items():
        if only and name != only:
            continue
        launches, stopped = check.capture(run)
        if stopped:
            result[f"{name}/launcher_stopped"] = {"error": stopped}
        seen: dict[str, int] = {}
        for launch in launches:
            n = seen[launch.fn.__name__] = seen.get(launch.fn.__name__, -1) + 1
            key = f"{name}/{launch.fn.__name__}#{n}"
            try:
                result[key] = instructions(launch.compile().asm["ptx"])
            except Exception as exc:  # noqa: BLE001 - reported, and counted
                result[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    Path(out).write_text(json.dumps(result))


def tree_package(root: Path, dest: Path) -> None:
    """DEST/pdserve: the tree at ROOT importable (benchmarks/pdserve_tree.sh's layout)."""
    script = f'source "{HERE}/pdserve_tree.sh" && pdserve_tree "{root}" "{dest}"'
    subprocess.run(["bash", "-c", script], check=True)


def compiled(root: Path, work: Path, only: str | None, tag: str) -> dict:
    pkg, out = work / f"pkg_{tag}", work / f"{tag}.json"
    tree_package(root, pkg)
    # (Triton 3.9 warns that its default FP fusion, on as in the GPU's 3.6, will change)
    # (a PYTHONPATH given stays after the tree's package: e.g. the GPU image's Triton 3.6)
    path = os.pathsep.join(p for p in (str(pkg), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--dump", str(out)]
    if only:
        cmd += ["--only", only]
    subprocess.run(cmd, check=True, env=env, cwd=work, timeout=1800)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the commit to compare this working tree with")
    ap.add_argument("--only", default=None, help="one scenario by name")
    ap.add_argument("--dump", default=None, help=argparse.SUPPRESS)  # the per-tree child
    args = ap.parse_args()
    if args.dump:
        dump(args.only, args.dump)
        return 0
    if not args.base:
        ap.error("--base is required")
    with tempfile.TemporaryDirectory(prefix="sm90_same_code_") as tmp:
        work = Path(tmp)
        base_tree = work / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(base_tree), args.base], check=True)  # fmt: skip
        try:
            base = compiled(base_tree, work, args.only, "base")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base_tree)], check=False)  # fmt: skip
        head = compiled(ROOT, work, args.only, "head")
    bad = 0
    for key in sorted(set(base) | set(head)):
        row: dict[str, object] = {"launch": key}
        a, b = base.get(key), head.get(key)
        if a is None or b is None:
            row["only_in"] = "head" if a is None else "base"
        elif isinstance(a, dict) or isinstance(b, dict):
            row["error"] = (a if isinstance(a, dict) else b)["error"]
            bad += 1
        elif a == b:
            row["same"] = True
        else:
            row["same"] = False
            ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
            row["lines_differing"] = sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops
                                         if op != "equal")  # fmt: skip
            row["lines"] = [len(a), len(b)]
            # the same instructions in another order (a hoisted address, a moved load)
            row["same_instructions_reordered"] = sorted(a) == sorted(b)
            bad += 1
        print(json.dumps(row), flush=True)
    print(json.dumps({"base": args.base, "differs_or_failed": bad}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
