"""The Helm chart's values (helm/pdserve/values.yaml) and what they become, rendered by a real
helm binary: the ConfigMap as a ServeConfig read the way the router's command line reads it;
the worker groups as `ray start` and Ray's KubeRay autoscaler read them; sizes, tier,
autoscaling, CPU-only and colocated installs, monitoring; the Ray token Secret (random, kept
across upgrades); and every refusal of bad values.
Helpers come from test_helm_chart.py.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import threading
from dataclasses import fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from test_helm_chart import (
    AUTOSCALE,
    COLOCATED,
    CPU_ONLY,
    FULLNAME,
    NAMESPACE,
    RAY_TOKEN_SECRET,
    RELEASE,
    SIZED,
    GiB,
    container,
    groups,
    head_pod,
    helm_binary,
    one,
    render,
    render_error,
    router_script,
)

from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.serve_flags import add_serve_args, config_from_args


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_binary()


def serve_data(objs: dict[str, list[dict]]) -> dict:
    data = yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"])
    assert isinstance(data, dict)
    return data


def ray_start_argv(params: dict[str, str]) -> list[str]:
    """`ray start` arguments as the pod's shell gets them. KubeRay (pod.go, convertParamMap)
    pastes each rayStartParam unquoted into a bash line as ` --KEY=VALUE ` (a "true" value
    as a bare flag), so the shell's word splitting and quote removal apply to VALUE."""
    line = ""
    for key in sorted(params):
        value = params[key]
        line += f" --{key} " if value.lower() == "true" else f" --{key}={value} "
    return shlex.split(line)


def test_configmap_is_the_router_serve_config(
    helm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.yaml holds only ServeConfig keys and, read through the router's own command
    line (`pdserve serve --config ... --ray-address auto ...`), gives the pools the chart
    sized: workers = replicas x gpusPerPod, one GPU each, pool resources on."""
    objs = render(helm, *SIZED)
    data = serve_data(objs)
    known = {f.name for f in fields(ServeConfig)}
    assert set(data) <= known, f"keys ServeConfig lacks: {sorted(set(data) - known)}"
    ServeConfig(**data)
    assert data["prefill_workers"] == 3 * 2
    assert data["decode_workers"] == 2 * 4
    assert data["pool_resources"] is True
    assert data["gpus_per_worker"] == 1
    assert data["tier_bytes"] == 8 * GiB
    assert data["autoscale"] is False
    assert not {k for k in data if k.startswith(("min_", "max_")) and k.endswith("_workers")}

    (tmp_path / "config.yaml").write_text(one(objs, "ConfigMap")["data"]["config.yaml"])
    argv = shlex.split(router_script(objs).split("exec ", 1)[1].splitlines()[0])
    assert argv[:2] == ["pdserve", "serve"]
    argv = [str(tmp_path / "config.yaml") if a == "/etc/pdserve/config.yaml" else a for a in argv]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    cfg = config_from_args(parser.parse_args(argv[2:]))
    assert (cfg.ray_address, cfg.host, cfg.port) == ("auto", "0.0.0.0", 8000)
    assert (cfg.prefill_workers, cfg.decode_workers, cfg.pool_resources) == (6, 8, True)
    assert cfg.api_key is None and cfg.admin_key is None


def test_keys_come_from_the_secret_never_the_configmap(helm: str) -> None:
    """API keys reach the router as env from the Secret (optional keys, so no Secret means
    no key) and never appear in the ConfigMap; putting one in serve is refused."""
    for sets, secret in [((), f"{FULLNAME}-auth"), (("auth.existingSecret=my-keys",), "my-keys")]:
        objs = render(helm, *sets)
        text = one(objs, "ConfigMap")["data"]["config.yaml"]
        assert "api_key" not in text and "admin_key" not in text
        env = {e["name"]: e for e in container(head_pod(objs), "router")["env"]}
        for var, key in [("PDSERVE_API_KEY", "apiKey"), ("PDSERVE_ADMIN_KEY", "adminKey")]:
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": key, "optional": True}
    for key in ("api_key", "admin_key", "api-key"):
        err = render_error(helm, f"serve.{key}=sk-secret")
        assert f"serve.{key} would put a key in the ConfigMap" in err


def test_worker_groups(helm: str) -> None:
    """Groups prefill/decode/tier with their pod counts, GPU limits and the ray start
    params that tie each pod to its pool."""
    g = groups(render(helm, *SIZED, "decode.maxReplicas=6"))
    assert list(g) == ["prefill", "decode", "tier"]
    expect = {"prefill": (3, 1, 4, 2), "decode": (2, 1, 6, 4), "tier": (1, 1, 1, 0)}
    for name, (replicas, lo, hi, gpus) in expect.items():
        grp = g[name]
        assert (grp["replicas"], grp["minReplicas"], grp["maxReplicas"]) == (replicas, lo, hi)
        res = grp["template"]["spec"]["containers"][0]["resources"]
        for side in ("limits", "requests"):
            if gpus:
                assert res[side]["nvidia.com/gpu"] == str(gpus)
            else:
                assert "nvidia.com/gpu" not in res[side]
        assert grp["rayStartParams"]["num-gpus"] == str(gpus)
    assert g["tier"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == (
        "12Gi"  # storeGiB 8 + overheadGiB 4
    )


CACHE_ENV = {
    "TRITON_CACHE_DIR": "/var/cache/pdserve/triton",
    "HF_HOME": "/var/cache/pdserve/huggingface",
    "PDSERVE_CACHE_DIR": "/var/cache/pdserve/pdserve",
}


HOST_PATH = {"hostPath": {"path": "/var/cache/pdserve", "type": "DirectoryOrCreate"}}
CLAIM = {"persistentVolumeClaim": {"claimName": "kernels"}}


@pytest.mark.parametrize(
    ("sets", "volume"),
    [
        ((), {"emptyDir": {}}),
        (("cache.type=hostPath",), HOST_PATH),
        (("cache.type=existingClaim", "cache.existingClaim=kernels"), CLAIM),
        (("cache.type=none",), None),
    ],
    ids=["emptyDir", "hostPath", "existingClaim", "none"],
)
def test_prefill_and_decode_pods_keep_their_caches(helm: str, sets: tuple, volume) -> None:
    """Prefill and decode pods mount the cache volume at /var/cache/pdserve and point
    Triton's kernel cache, Hugging Face's and pdserve's model caches into it (a restarted
    worker then loads its compiled kernels instead of compiling them); the tier pod, which
    loads no model, does not; cache.type none mounts nothing."""
    g = groups(render(helm, *sets))
    for name in ("prefill", "decode", "tier"):
        spec = g[name]["template"]["spec"]
        c = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        if volume is None or name == "tier":
            assert "volumes" not in spec and "volumeMounts" not in c
            assert not set(CACHE_ENV) & set(env)
            continue
        assert spec["volumes"] == [{"name": "pdserve-cache", **volume}]
        assert c["volumeMounts"] == [{"name": "pdserve-cache", "mountPath": "/var/cache/pdserve"}]
        assert {k: env[k] for k in CACHE_ENV} == CACHE_ENV


def test_extra_volumes_reach_the_pods(helm: str) -> None:
    """A model on a claim: head.volumes / volumeMounts reach the router container (it reads
    the model's config and tokenizer), prefill's and decode's their Ray containers, next to
    the cache volume."""
    claim = {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    mount = {"name": "models", "mountPath": "/models", "readOnly": True}
    sets = []
    for where in ("head", "prefill", "decode"):
        sets += [
            f"{where}.volumes[0].name=models",
            f"{where}.volumes[0].persistentVolumeClaim.claimName=models",
            f"{where}.volumes[0].persistentVolumeClaim.readOnly=true",
            f"{where}.volumeMounts[0].name=models",
            f"{where}.volumeMounts[0].mountPath=/models",
            f"{where}.volumeMounts[0].readOnly=true",
        ]
    objs = render(helm, *sets, "serve.model=/models/qwen3-8b")
    head = head_pod(objs)["spec"]
    assert head["volumes"][-1] == claim
    assert container(head_pod(objs), "router")["volumeMounts"][-1] == mount
    assert mount not in container(head_pod(objs), "ray-head").get("volumeMounts", [])
    g = groups(objs)
    for name in ("prefill", "decode"):
        spec = g[name]["template"]["spec"]
        assert [v["name"] for v in spec["volumes"]] == ["pdserve-cache", "models"]
        assert spec["volumes"][1] == claim
        assert spec["containers"][0]["volumeMounts"][1] == mount
    assert "volumes" not in g["tier"]["template"]["spec"]


def test_ray_start_reads_pool_resources(helm: str) -> None:
    """Each pod's `ray start` (as KubeRay's shell line hands it over, parsed by Ray's own
    CLI) advertises one pdserve_<role> unit per worker; the head advertises none and no GPU.
    Guards the quoting: unquoted JSON would be split by the shell."""
    from ray._private.utils import parse_resources_json
    from ray.autoscaler._private.cli_logger import cf, cli_logger
    from ray.scripts.scripts import start

    objs = render(helm, *SIZED)
    expect = {"prefill": {"pdserve_prefill": 2}, "decode": {"pdserve_decode": 4}}
    expect["tier"] = {"pdserve_tier": 1}
    for name, grp in groups(objs).items():
        params = start.make_context("start", ray_start_argv(grp["rayStartParams"])).params
        assert parse_resources_json(params["resources"], cli_logger, cf) == expect[name]
        assert params["num_gpus"] == {"tier": 0}.get(name, expect[name][f"pdserve_{name}"])
    head = one(objs, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    params = start.make_context("start", ray_start_argv(head)).params
    assert params["num_gpus"] == 0 and params["resources"] == "{}"


def test_ray_autoscaler_reads_the_groups(helm: str) -> None:
    """Ray's KubeRay autoscaler (the code in the head pod's sidecar) derives node types
    whose resources hold the pdserve_* units, so pending pool actors make it add the right
    pods, up to maxReplicas."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cr = one(render(helm, *SIZED, "decode.maxReplicas=6"), "RayCluster")
    types = _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]
    assert types["prefill"]["resources"]["pdserve_prefill"] == 2
    assert types["prefill"]["resources"]["GPU"] == 2
    assert types["decode"]["resources"]["pdserve_decode"] == 4
    assert types["decode"]["resources"]["GPU"] == 4
    assert (types["decode"]["min_workers"], types["decode"]["max_workers"]) == (1, 6)
    assert types["tier"]["resources"]["pdserve_tier"] == 1
    assert types["tier"]["resources"]["memory"] == 12 * GiB
    assert not any(k.startswith("pdserve_") for k in types["headgroup"]["resources"])


def test_monitoring(helm: str) -> None:
    """Prometheus annotations on the head pod by default (off on request); a ServiceMonitor
    on request, selecting the router Service and scraping its http port at /metrics."""
    ann = head_pod(render(helm))["metadata"]["annotations"]
    assert ann == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    assert "annotations" not in head_pod(render(helm, "monitoring.annotations=false"))["metadata"]

    objs = render(
        helm,
        "monitoring.serviceMonitor.enabled=true",
        "monitoring.serviceMonitor.interval=15s",
        "monitoring.serviceMonitor.labels.release=prom",
    )
    sm = one(objs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    svc = one(objs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert svc["spec"]["ports"][0]["name"] == "http"


def test_router_tls(helm: str) -> None:
    """router.tls: the Secret mounted read-only in the router container, the ConfigMap's
    ssl_* keys pointing into it (a ServeConfig with TLS on, client certificates optional
    against its ca.crt), HTTPS probes (kubelet checks no certificate), the Prometheus
    scheme annotation and an HTTPS ServiceMonitor with the tlsConfig given. (The
    RayCluster against KubeRay's schema: test_helm_chart, "router-tls".)"""
    objs = render(
        helm, "router.tls.secretName=pdserve-tls", "router.tls.clientCertReqs=1",
        "monitoring.serviceMonitor.enabled=true",
        "monitoring.serviceMonitor.tlsConfig.serverName=pdserve.example.com",
    )  # fmt: skip
    data = serve_data(objs)
    assert {k: v for k, v in data.items() if k.startswith("ssl_")} == {
        "ssl_certfile": "/etc/pdserve-tls/tls.crt", "ssl_keyfile": "/etc/pdserve-tls/tls.key",
        "ssl_ca_certs": "/etc/pdserve-tls/ca.crt", "ssl_cert_reqs": 1,
    }  # fmt: skip
    assert ServeConfig(**data).tls.scheme == "https"
    pod = head_pod(objs)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "pdserve-tls"}
    router = container(pod, "router")
    assert {"name": "tls", "mountPath": "/etc/pdserve-tls", "readOnly": True} in router[
        "volumeMounts"
    ]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert router[probe]["httpGet"]["scheme"] == "HTTPS", probe
    assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    (endpoint,) = one(objs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"serverName": "pdserve.example.com"}
    # Without client certificates the CA is not asked for; without TLS nothing changes.
    data = serve_data(render(helm, "router.tls.secretName=pdserve-tls"))
    assert data["ssl_certfile"] == "/etc/pdserve-tls/tls.crt" and "ssl_ca_certs" not in data
    plain = render(helm)
    assert not {k for k in serve_data(plain) if k.startswith("ssl_")}
    router = container(head_pod(plain), "router")
    assert all("scheme" not in router[p]["httpGet"] for p in ("startupProbe", "livenessProbe"))


def test_tier_disabled(helm: str) -> None:
    """tier.enabled=false drops the tier group and tells pdserve there is no tier."""
    objs = render(helm, "tier.enabled=false")
    assert list(groups(objs)) == ["prefill", "decode"]
    data = serve_data(objs)
    assert data["tier_bytes"] == 0
    ServeConfig(**data)


def test_autoscaling_bounds(helm: str) -> None:
    """autoscaling.enabled renders autoscale and the four bounds: by default the groups'
    min/maxReplicas x workers per pod, else the given numbers; ServeConfig accepts them."""
    data = serve_data(render(helm, *SIZED, *AUTOSCALE))
    assert data["autoscale"] is True
    bounds = {k: v for k, v in data.items() if k.endswith("_workers") and k[:4] in ("min_", "max_")}
    assert bounds == {
        "min_prefill_workers": 1 * 2,
        "max_prefill_workers": 4 * 2,
        "min_decode_workers": 1 * 4,
        "max_decode_workers": 4 * 4,
    }
    ServeConfig(**data)
    data = serve_data(render(helm, *SIZED, *AUTOSCALE, "autoscaling.decode.minWorkers=8"))
    assert data["min_decode_workers"] == 8
    ServeConfig(**data)


def test_cpu_only_install(helm: str) -> None:
    """gpusPerPod 0 on both groups: no GPU anywhere, device cpu, one worker per pod."""
    objs = render(helm, *CPU_ONLY)
    data = serve_data(objs)
    assert (data["device"], data["gpus_per_worker"]) == ("cpu", 0)
    assert (data["prefill_workers"], data["decode_workers"]) == (1, 2)
    ServeConfig(**data)
    assert "nvidia.com/gpu" not in json.dumps(one(objs, "RayCluster"))
    assert groups(objs)["decode"]["rayStartParams"]["resources"] == """'{"pdserve_decode":1}'"""


def test_colocated(helm: str) -> None:
    """Colocated mode with the prefill group at 0 pods gives a ServeConfig with no prefill
    workers (and, autoscaling, prefill bounds 0)."""
    objs = render(helm, *COLOCATED)
    data = serve_data(objs)
    assert (data["mode"], data["prefill_workers"]) == ("colocated", 0)
    assert groups(objs)["prefill"]["replicas"] == 0
    ServeConfig(**data)
    data = serve_data(render(helm, *COLOCATED, *AUTOSCALE))
    assert (data["min_prefill_workers"], data["max_prefill_workers"]) == (0, 0)
    ServeConfig(**data)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("prefill.minReplicas=5",), "prefill.minReplicas (5) must be <= prefill.maxReplicas (4)"),
        (("decode.replicas=9",), "decode.replicas (9) must be within"),
        (("prefill.replicas=-1",), "at '/prefill/replicas': minimum: got -1, want 0"),
        (("decode.maxReplicas=-2",), "at '/decode/maxReplicas': minimum: got -2, want 0"),
        (("image.pullPolicy=Sometimes",), "at '/image/pullPolicy'"),
        (("head.env[0].name=A", "head.env[0].value=1"), "at '/head/env/0/value'"),
        (("prefil.replicas=2",), "additional properties 'prefil' not allowed"),
        (("serve.mode=colocated",), "serve.mode colocated runs no prefill workers"),
        (("prefill.replicas=0", "prefill.minReplicas=0"), "prefill.replicas must be >= 1"),
        (("decode.replicas=0", "decode.minReplicas=0"), "needs a decode worker"),
        (("prefill.gpusPerPod=0",), "must both be 0 (a CPU-only install) or both >= 1"),
        (("serve.prefill_workers=3",), "serve.prefill_workers is set by the chart"),
        (("serve.ray_address=x:1",), "serve.ray_address is set by the chart"),
        (
            (*AUTOSCALE, "autoscaling.prefill.maxWorkers=9"),
            "autoscaling.prefill.maxWorkers (9) exceeds what prefill.maxReplicas pods hold",
        ),
        (
            (*AUTOSCALE, "autoscaling.decode.minWorkers=3", "autoscaling.decode.maxWorkers=2"),
            "autoscaling.decode.minWorkers (3) must be <= autoscaling.decode.maxWorkers (2)",
        ),
        (
            (*AUTOSCALE, "autoscaling.decode.minWorkers=3"),
            "the 1 workers of decode.replicas must be within [minWorkers, maxWorkers] = [3, 4]",
        ),
        (("rayAuth.mode=Token",), "at '/rayAuth/mode': value must be one of 'token', 'disabled'"),
        (("rayAuth.mode=",), "at '/rayAuth/mode': value must be one of 'token', 'disabled'"),
        (("rayAuth.existingSecret=My_Secret",), "at '/rayAuth/existingSecret'"),
        (
            ("rayAuth.mode=disabled", "rayAuth.existingSecret=mine"),
            "rayAuth.existingSecret (mine) is set but rayAuth.mode is disabled",
        ),
        (("rayVersion=2.51.0",), "rayAuth.mode token needs Ray >= 2.52.0"),
        (("serve.kv_transport=cuda_ipc",), "serve.kv_transport cuda_ipc cannot move KV"),
        (("serve.kv_transport=nccl",), "serve.kv_transport nccl cannot move KV"),
        (
            ("head.env[0].name=RAY_AUTH_MODE", "head.env[0].value=disabled"),
            "head.env sets RAY_AUTH_MODE, which the chart sets on every container from rayAuth",
        ),
        (
            ("router.env[0].name=RAY_AUTH_TOKEN", "router.env[0].value=t"),
            "router.env sets RAY_AUTH_TOKEN",
        ),
        (("tier.env[0].name=RAY_AUTH_MODE", "tier.env[0].value=x"), "tier.env sets RAY_AUTH_MODE"),
        (("cache.type=pvc",), "at '/cache/type': value must be one of 'none', 'emptyDir'"),
        (("cache.type=hostPath", "cache.hostPath="), "cache.type hostPath needs cache.hostPath"),
        (("cache.type=existingClaim",), "cache.type existingClaim needs cache.existingClaim"),
        (
            ("decode.env[0].name=TRITON_CACHE_DIR", "decode.env[0].value=/t"),
            "decode.env sets TRITON_CACHE_DIR, which the chart points at the cache volume",
        ),
        (
            (
                "prefill.volumes[0].name=c",
                "prefill.volumes[0].emptyDir.medium=Memory",
                "prefill.volumeMounts[0].name=c",
                "prefill.volumeMounts[0].mountPath=/var/cache/pdserve",
            ),
            "prefill.volumeMounts mounts /var/cache/pdserve, where the chart mounts the cache",
        ),
        (
            ("head.volumeMounts[0].name=m",),
            "at '/head/volumeMounts/0': missing property 'mountPath'",
        ),
        (
            ("router.tls.secretName=t", "router.tls.clientCertReqs=2"),
            "router.tls.clientCertReqs 2 (required) would fail every probe",
        ),
        (("router.tls.clientCertReqs=3",), "at '/router/tls/clientCertReqs': maximum"),
        (("router.tls.secretName=My_TLS",), "at '/router/tls/secretName'"),
        (
            ("router.tls.clientCertReqs=1",),
            "router.tls.clientCertReqs needs router.tls.secretName",
        ),
        (("serve.ssl_certfile=/c.pem",), "serve.ssl_certfile is set by the chart from router"),
        (("serve.ssl_cert_reqs=1",), "serve.ssl_cert_reqs is set by the chart from router"),
        (("serve.ssl_ciphers=HIGH",), "serve.ssl_ciphers needs router.tls.secretName"),
    ],
)
def test_bad_values_are_refused(helm: str, sets: tuple, message: str) -> None:
    """Each bad value set makes `helm template` fail with a message that names the rule."""
    assert message in render_error(helm, *sets)


def secret_token(secret: dict) -> str:
    """The auth_token of a rendered Secret, from stringData or (base64) data."""
    if "auth_token" in secret.get("stringData", {}):
        return secret["stringData"]["auth_token"]
    return base64.b64decode(secret["data"]["auth_token"], validate=True).decode()


def test_ray_token_secret(helm: str) -> None:
    """The chart's Secret holds a random token under auth_token (the key KubeRay reads):
    long, letters and digits only, a new one on each render without a cluster."""
    tokens = set()
    for _ in range(2):
        secret = one(render(helm), "Secret")
        assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == (
            RAY_TOKEN_SECRET,
            NAMESPACE,
        )
        token = secret_token(secret)
        assert len(token) >= 32 and token.isascii() and token.isalnum(), token
        tokens.add(token)
    assert len(tokens) == 2


class _KubeAPIStub(BaseHTTPRequestHandler):
    """Just enough of a Kubernetes API server for `helm template --dry-run=server`: discovery
    of the kinds the chart renders, and GET of the objects in `objects` (by URL path);
    anything else is 404, which helm takes as "not there yet"."""

    objects: dict[str, dict] = {}

    @staticmethod
    def _resources(group_version: str, kinds: dict[str, str]) -> dict:
        items = [
            {"name": n, "kind": k, "namespaced": True, "verbs": ["get"]} for n, k in kinds.items()
        ]
        return {"kind": "APIResourceList", "groupVersion": group_version, "resources": items}

    def do_GET(self) -> None:
        ray = {"groupVersion": "ray.io/v1", "version": "v1"}
        v1 = {"secrets": "Secret", "configmaps": "ConfigMap", "services": "Service"}
        discovery = {
            "/version": {"major": "1", "minor": "30", "gitVersion": "v1.30.0"},
            "/api": {"kind": "APIVersions", "versions": ["v1"]},
            "/apis": {"kind": "APIGroupList", "groups": [
                {"name": "ray.io", "versions": [ray], "preferredVersion": ray}]},
            "/api/v1": self._resources("v1", v1),
            "/apis/ray.io/v1": self._resources("ray.io/v1", {"rayclusters": "RayCluster"}),
        }  # fmt: skip
        path = self.path.split("?")[0]
        body = discovery.get(path) or self.objects.get(path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body or {"kind": "Status", "code": 404}).encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("in_cluster", [True, False], ids=["upgrade", "first-install"])
def test_ray_token_kept_on_upgrade(helm: str, tmp_path: Path, in_cluster: bool) -> None:
    """With the chart's Secret already in the cluster, a render that sees the cluster (as
    `helm upgrade` does; here `--dry-run=server` against a stub API server) keeps its token,
    so running pods and new ones agree; with no Secret there, a new token."""
    kept = "kept0token0" * 4
    owner = {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
    meta = {"name": RAY_TOKEN_SECRET, "namespace": NAMESPACE, "annotations": owner}
    meta["labels"] = {"app.kubernetes.io/managed-by": "Helm"}  # helm's ownership marks
    data = {"auth_token": base64.b64encode(kept.encode()).decode()}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data}
    path = f"/api/v1/namespaces/{NAMESPACE}/secrets/{RAY_TOKEN_SECRET}"
    objects = {path: secret} if in_cluster else {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_KubeAPIStub,), {"objects": objects}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(  # JSON is YAML
        json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "x",
            "clusters": [{"name": "c", "cluster": {"server": f"http://{host}:{port}"}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        })
    )  # fmt: skip
    try:
        objs = render(
            helm,
            extra=("--dry-run=server", "--disable-openapi-validation"),
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )
    finally:
        server.shutdown()
        server.server_close()
    token = secret_token(one(objs, "Secret"))
    assert (token == kept) is in_cluster and len(token) >= 32, token


def test_ray_auth_mode_checked_without_the_schema(helm: str) -> None:
    """A wrong rayAuth.mode is refused by the templates too, not only by values.schema.json
    (which --skip-schema-validation turns off)."""
    err = render_error(helm, "rayAuth.mode=Token", extra=("--skip-schema-validation",))
    assert 'rayAuth.mode must be token or disabled, got "Token"' in err
