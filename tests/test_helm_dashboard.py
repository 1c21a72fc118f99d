"""The chart's Grafana dashboard (helm/pdserve/dashboards/pdserve.json): rendered into a
ConfigMap on request, and every query in it asks for series a real server exports, with
the labels it groups and names them by (checked against the README's PD server's
/metrics after a request, so a renamed metric or label fails here, not on a blank panel).
Helpers come from test_helm_chart.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from test_helm_chart import NAMESPACE, helm_binary, one, render

METRIC = re.compile(r"pdserve:[a-z0-9_]+")
BY = re.compile(r"by \(([^)]*)\)")
LEGEND = re.compile(r"\{\{(\w+)\}\}")


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_binary()


def _dashboard(helm: str) -> tuple[dict, dict]:
    objs = render(helm, "monitoring.grafanaDashboard.enabled=true")
    cm = next(o for o in objs["ConfigMap"] if o["metadata"]["name"].endswith("-dashboard"))
    return cm, json.loads(cm["data"]["pdserve.json"])


def _series(metrics_text: str) -> dict[str, set[str]]:
    """Exported sample names -> the label names seen on them."""
    out: dict[str, set[str]] = {}
    for line in metrics_text.splitlines():
        if line.startswith("pdserve:"):
            name, _, rest = line.partition("{")
            name = name.split(" ")[0]
            labels = set(re.findall(r"(\w+)=\"", rest)) if rest else set()
            out.setdefault(name, set()).update(labels)
    return out


def test_dashboard_configmap(helm: str) -> None:
    cm, dash = _dashboard(helm)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    assert dash["uid"] == "pdserve" and len(dash["panels"]) >= 10
    assert all(
        t["datasource"]["uid"] == "${datasource}" for p in dash["panels"] for t in p["targets"]
    )
    assert "ConfigMap" not in render(helm) or all(
        not o["metadata"]["name"].endswith("-dashboard") for o in render(helm)["ConfigMap"]
    )
    custom = render(
        helm, "monitoring.grafanaDashboard.enabled=true", "monitoring.grafanaDashboard.labels.x=y"
    )
    assert one({"ConfigMap": [o for o in custom["ConfigMap"] if "dashboard" in o["metadata"]["name"]]},
               "ConfigMap")["metadata"]["labels"]["x"] == "y"  # fmt: skip
    # Under serve.metrics_prefix the queries name the series as the server exports them.
    vllm = render(helm, "monitoring.grafanaDashboard.enabled=true", "serve.metrics_prefix=vllm:")
    (cm,) = [o for o in vllm["ConfigMap"] if o["metadata"]["name"].endswith("-dashboard")]
    exprs = [t["expr"] for p in json.loads(cm["data"]["pdserve.json"])["panels"]
             for t in p["targets"]]  # fmt: skip
    assert all("vllm:" in e and "pdserve:" not in e for e in exprs), exprs
    (config,) = [o for o in vllm["ConfigMap"] if "config.yaml" in o["data"]]
    assert yaml.safe_load(config["data"]["config.yaml"])["metrics_prefix"] == "vllm:"


def test_every_query_reads_exported_series(helm: str, pd) -> None:
    import httpx

    r = httpx.post(
        pd.url + "/v1/completions",
        json={"prompt": "Tell me about the city of Paris and its history. " * 3, "max_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    series = _series(pd.metrics())
    _, dash = _dashboard(helm)
    checked = 0
    for panel in dash["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            names = METRIC.findall(expr)
            assert names, (panel["title"], expr)
            for name in names:
                assert name in series, f"{panel['title']}: {name} is not exported"
            labels = {x.strip() for group in BY.findall(expr) for x in group.split(",")}
            labels |= set(LEGEND.findall(target["legendFormat"]))
            have = set().union(*(series[n] for n in names))
            assert labels <= have, f"{panel['title']}: labels {labels - have} not on {names}"
            checked += 1
    assert checked >= 15
