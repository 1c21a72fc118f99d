"""`pdserve.cli.main` run in the test's own process: its exit status and what it wrote to
stderr. A `python -m pdserve.cli` process costs each refusal ~6 s of imports; the tests
that check the CLI's refusals run most of them this way, and a few through `python -m`
(the real entry point's exit status and streams)."""

from __future__ import annotations

import contextlib
import io


def cli_main(*args: str) -> tuple[int, str]:
    """(exit status, stderr) of `pdserve.cli.main(args)`; argparse's exits included."""
    from pdserve.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse refuses a flag by exiting
            code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()
