"""The names /metrics gives its series: built under `PREFIX`, exported under the
operator's prefix (`--metrics-prefix`), which must start a name Prometheus accepts.
Kept apart from the registry so the serve configuration checks a prefix without
importing prometheus_client."""

from __future__ import annotations

import re

PREFIX = "pdserve:"  # the series' names in code; /metrics may show another
_PREFIX_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def check_prefix(prefix: str) -> None:
    """A metric-name prefix Prometheus accepts (`pdserve:`, `vllm:`), or a ValueError."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"--metrics-prefix must start a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*, "
            f"e.g. 'pdserve:' or 'vllm:'), got {prefix!r}"
        )
