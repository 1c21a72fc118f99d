"""vLLM's `--root-path` (cluster/root_path.py): the path a route is matched on, which the
API key, CORS and /load's count read too. On a real server: test_serve_faults (the API
key under the prefix) and test_ops_api (the operator's routes, the dashboard, OpenAPI)."""

from __future__ import annotations

import pytest
from starlette._utils import get_route_path

from pdserve.cluster.root_path import check_root_path, route_path


@pytest.mark.parametrize(
    "path, root, want",
    [
        ("/v1/models", "", "/v1/models"),
        ("/v1/models", "/pd", "/v1/models"),  # a proxy that strips the prefix
        ("/pd/v1/models", "/pd", "/v1/models"),  # one that forwards the path as it came
        ("/pd", "/pd", ""),
        ("/pdx/v1/models", "/pd", "/pdx/v1/models"),  # not at a segment boundary
        ("/a/b/v1", "/a/b", "/v1"),
    ],
)
def test_the_route_path_is_the_one_routing_matches(path, root, want):
    scope = {"path": path, "root_path": root}
    assert route_path(scope) == want == get_route_path(scope)


@pytest.mark.parametrize(
    "value, want", [(None, ""), ("", ""), ("/", ""), ("/pd", "/pd"), ("/pd/", "/pd"),
                    ("/a/b-c_d.e", "/a/b-c_d.e")],
)  # fmt: skip
def test_a_root_path_is_kept_as_the_scope_holds_it(value, want):
    assert check_root_path(value) == want


@pytest.mark.parametrize("value", ["pd", "/p d", "/a?b", "/a#b", "//pd", "/a//b", "/%2e", 5])
def test_other_root_paths_are_refused(value):
    with pytest.raises(ValueError, match="--root-path"):
        check_root_path(value)
