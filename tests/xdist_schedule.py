"""How `python -m pytest -n 2` (the README's test command) splits the suite between its
workers: by whole files, so that a module's server starts once, with the files that use
the session's `pd` and `colocated` servers together, so that those start once too.

pytest-xdist's own `--dist loadgroup` would express this with marks, but under pytest 9.2
it no longer groups (it renames `item._nodeid`, which pytest stopped reading; xdist issue
#1386), so the grouping is this scheduler's. It overrides `_split_scope`, the method xdist's own file
and group schedulers override (pyproject.toml keeps xdist below 4 for it)."""

from __future__ import annotations

# conftest.py refuses a run in which a file outside this set uses one of those servers.
SHARED_SERVER_FILES = frozenset(
    {
        "test_bench_contract.py",
        "test_helm_dashboard.py",
        "test_run_batch.py",
        "test_serve_batch_echo.py",
        "test_serve_e2e.py",
        "test_serve_embeddings.py",
        "test_serve_fuzz.py",
        "test_serve_responses.py",
        "test_serve_speculative.py",
        "test_serve_token_ids.py",
        "test_serve_vllm_compat.py",
    }
)


def scope_of(nodeid: str) -> str:
    """A test's scope: its file, or "shared-servers" for the files in that set."""
    path = nodeid.split("::", 1)[0]
    return "shared-servers" if path.rsplit("/", 1)[-1] in SHARED_SERVER_FILES else path


def make_scheduler(config, log):
    """xdist's scope scheduling with `scope_of` as the scope (xdist is imported here: the
    GPU run has no xdist, and collection reads the set above)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return FileGroups(config, log)
