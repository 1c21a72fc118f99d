"""The Helm chart (helm/pdserve) rendered by a real helm binary (helm/get-helm.sh): `helm
lint`; the rendered objects; the RayCluster against KubeRay's v1 CRD schema; the head pod and
the router's wait-for-head script; the router Service; Ray token authentication (rayAuth) on
every container; the NOTES. test_helm_values.py covers what the values turn into (serve
config, pools, sizes) and the refusals of bad values, with the helpers defined here. No
cluster: what a running KubeRay does with the objects is out of reach here (helm/README.md
says what that leaves untested).
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "pdserve"
NAMESPACE = "pdserve-test"
RELEASE = "rel"
FULLNAME = "rel-pdserve"
RAY_TOKEN_SECRET = f"{FULLNAME}-ray-token"
GiB = 1 << 30

# More than one pod per group and more than one GPU per pod, different per group, so that
# "workers = replicas x gpusPerPod" cannot pass by accident (1 x 1 = 1 = either factor).
SIZED = ("prefill.replicas=3", "prefill.gpusPerPod=2", "decode.replicas=2", "decode.gpusPerPod=4")
CPU_ONLY = ("prefill.gpusPerPod=0", "decode.gpusPerPod=0", "decode.replicas=2")
COLOCATED = (
    "serve.mode=colocated",
    "prefill.replicas=0",
    "prefill.minReplicas=0",
    "prefill.maxReplicas=0",
)
AUTOSCALE = ("autoscaling.enabled=true",)


@functools.cache
def helm_binary() -> str:
    """The helm binary's path (fetched once by helm/get-helm.sh); both helm test files'
    `helm` fixtures return it."""
    r = subprocess.run(
        ["bash", str(ROOT / "helm" / "get-helm.sh")], capture_output=True, text=True, timeout=900
    )
    if r.returncode != 0:
        pytest.fail(
            f"helm/get-helm.sh exited {r.returncode}:\n{r.stdout}\n{r.stderr}", pytrace=False
        )
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_binary()


@pytest.fixture(scope="module")
def crd_schema() -> dict:
    # KubeRay's v1 RayCluster schema (tests/data/README.md). Used as is: its int-or-string
    # fields (quantities, probe ports) are already `anyOf: [integer, string]`, which
    # jsonschema enforces, and the x-kubernetes-* keywords it ignores only concern
    # server-side merging, not the shape of a document.
    with gzip.open(ROOT / "tests" / "data" / "raycluster_v1_schema.json.gz") as f:
        schema = json.load(f)
    jsonschema.Draft7Validator.check_schema(schema)
    return schema


def _template(
    helm: str, sets: tuple[str, ...], *extra: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def render(
    helm: str, *sets: str, extra: tuple[str, ...] = (), env: dict | None = None
) -> dict[str, list[dict]]:
    """The rendered objects, by kind."""
    r = _template(helm, sets, *extra, env=env)
    assert r.returncode == 0, f"helm template {sets} failed:\n{r.stderr}"
    by_kind: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(r.stdout):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def render_error(helm: str, *sets: str, extra: tuple[str, ...] = ()) -> str:
    r = _template(helm, sets, *extra)
    assert r.returncode != 0, f"helm template {sets} rendered; a refusal was expected"
    assert "kind: RayCluster" not in r.stdout
    return r.stderr


def one(objs: dict[str, list[dict]], kind: str) -> dict:
    assert len(objs.get(kind, [])) == 1, f"expected one {kind}, got {len(objs.get(kind, []))}"
    return objs[kind][0]


def groups(objs: dict[str, list[dict]]) -> dict[str, dict]:
    return {g["groupName"]: g for g in one(objs, "RayCluster")["spec"]["workerGroupSpecs"]}


def head_pod(objs: dict[str, list[dict]]) -> dict:
    return one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"]


def pod_templates(objs: dict[str, list[dict]]) -> dict[str, dict]:
    """Every pod template of the RayCluster: "head" and each worker group by name."""
    return {"head": head_pod(objs)} | {n: g["template"] for n, g in groups(objs).items()}


def container(pod_template: dict, name: str) -> dict:
    by_name = {c["name"]: c for c in pod_template["spec"]["containers"]}
    assert name in by_name, f"no container {name!r}; have {sorted(by_name)}"
    return by_name[name]


def router_script(objs: dict[str, list[dict]]) -> str:
    router = container(head_pod(objs), "router")
    assert router["command"] == ["/bin/bash", "-c"]
    return router["args"][0]


def test_lint(helm: str) -> None:
    """The chart passes `helm lint`, also with --strict (which fails on lint warnings)."""
    for extra in ([], ["--strict"]):
        r = subprocess.run(
            [helm, "lint", *extra, str(CHART)], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, f"helm lint {extra}:\n{r.stdout}\n{r.stderr}"
        assert "0 chart(s) failed" in r.stdout


def test_default_render_objects(helm: str) -> None:
    """Defaults render one RayCluster, one ConfigMap, one Service and the Ray token Secret,
    nothing else."""
    objs = render(helm)
    assert {k: len(v) for k, v in objs.items()} == {
        "RayCluster": 1,
        "ConfigMap": 1,
        "Service": 1,
        "Secret": 1,
    }
    for obj in (o for v in objs.values() for o in v):
        name = RAY_TOKEN_SECRET if obj["kind"] == "Secret" else FULLNAME
        assert obj["metadata"]["name"] == name
        assert obj["metadata"]["namespace"] == NAMESPACE
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["helm.sh/chart"] == "pdserve-0.1.0"
    cr = one(objs, "RayCluster")
    assert cr["apiVersion"] == "ray.io/v1"
    assert cr["spec"]["rayVersion"] == "2.60.0"
    assert cr["spec"]["enableInTreeAutoscaling"] is True
    assert container(head_pod(objs), "router")["image"] == "pdserve:0.1.0"  # appVersion


@pytest.mark.parametrize(
    "sets",
    [
        (),
        SIZED,
        CPU_ONLY,
        COLOCATED,
        ("tier.enabled=false",) + AUTOSCALE,
        (
            "head.env[0].name=A",
            "head.env[0].value=x",
            "prefill.nodeSelector.pool=gpu",
            "decode.tolerations[0].key=nvidia.com/gpu",
            "decode.tolerations[0].operator=Exists",
            "imagePullSecrets[0].name=regcred",
            "prefill.rayStartParams.object-store-memory=1000000000",
        ),
        ("rayAuth.existingSecret=mine",),
        ("rayAuth.mode=disabled",),
        (
            "cache.type=hostPath",
            "head.volumes[0].name=m",
            "head.volumes[0].persistentVolumeClaim.claimName=m",
            "head.volumeMounts[0].name=m",
            "head.volumeMounts[0].mountPath=/models",
            "decode.volumes[0].name=m",
            "decode.volumes[0].persistentVolumeClaim.claimName=m",
            "decode.volumeMounts[0].name=m",
            "decode.volumeMounts[0].mountPath=/models",
        ),
        ("cache.type=existingClaim", "cache.existingClaim=kernels"),
        ("router.tls.secretName=pdserve-tls", "router.tls.clientCertReqs=1"),
    ],
    ids=[
        "default",
        "sized",
        "cpu-only",
        "colocated",
        "no-tier-autoscale",
        "extras",
        "ray-token-secret",
        "ray-auth-disabled",
        "cache-on-the-node-and-a-model-volume",
        "cache-on-a-claim",
        "router-tls",
    ],
)
def test_raycluster_matches_kuberay_crd_schema(helm: str, crd_schema: dict, sets: tuple) -> None:
    """The RayCluster is a valid ray.io/v1 object for KubeRay (guards: a rayStartParam
    rendered as a number, a float quantity, a misplaced or misspelled field)."""
    cr = one(render(helm, *sets), "RayCluster")
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(crd_schema).iter_errors(cr)
    ]
    assert errors == []


def test_crd_schema_check_can_fail(helm: str, crd_schema: dict) -> None:
    """The schema check above rejects the mistakes it is there for (so an empty or
    mis-extracted schema cannot pass everything)."""
    validator = jsonschema.Draft7Validator(crd_schema)

    def worker_resources(spec: dict) -> dict:
        return spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]

    mutations = {
        "num-gpus as a number": lambda s: s["headGroupSpec"]["rayStartParams"].update(
            {"num-gpus": 0}
        ),
        "cpu as a float": lambda s: worker_resources(s)["limits"].update(cpu=0.5),
        "no groupName": lambda s: s["workerGroupSpecs"][0].pop("groupName"),
        "replicas as a string": lambda s: s["workerGroupSpecs"][0].update(replicas="1"),
        "an unknown auth mode": lambda s: s["authOptions"].update(mode="Token"),
    }
    rendered = one(render(helm), "RayCluster")
    assert not list(validator.iter_errors(rendered))
    for what, mutate in mutations.items():
        cr = copy.deepcopy(rendered)
        mutate(cr["spec"])
        assert list(validator.iter_errors(cr)), f"schema accepted {what}"


def test_head_pod(helm: str) -> None:
    """The head pod runs the Ray head first (KubeRay's Ray container) and the router, both
    on one /tmp/ray emptyDir; the router joins with --ray-address auto, reads the ConfigMap
    and is probed on its http port: /health for start and readiness (503 while no decode
    worker is ready), /version for liveness (a worker restart must not restart it)."""
    objs = render(helm)
    pod = head_pod(objs)
    assert [c["name"] for c in pod["spec"]["containers"]] == ["ray-head", "router"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    tmp_ray = set()
    for c in pod["spec"]["containers"]:
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        tmp_ray.add(mounts["/tmp/ray"])
    assert len(tmp_ray) == 1 and volumes[tmp_ray.pop()] == {"name": "ray-logs", "emptyDir": {}}
    router = container(pod, "router")
    assert "--ray-address auto" in " ".join(router["command"] + router["args"])
    config_mount = {m["mountPath"]: m["name"] for m in router["volumeMounts"]}["/etc/pdserve"]
    assert volumes[config_mount]["configMap"]["name"] == one(objs, "ConfigMap")["metadata"]["name"]
    assert router["ports"] == [{"name": "http", "containerPort": 8000}]
    for probe in ("startupProbe", "readinessProbe"):
        assert router[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/version", "port": "http"}
    startup = router["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load: minutes


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("healthy_after", [2, None], ids=["head-comes-up", "head-never-up"])
def test_router_waits_for_head(helm: str, tmp_path: Path, healthy_after: int | None) -> None:
    """The router's script retries `ray health-check` a bounded number of times, then execs
    pdserve serve with the exact flags, or exits 1 with a message instead of hanging."""
    objs = render(helm, "router.waitForHead.tries=3", "router.waitForHead.sleepSeconds=0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "ray_calls"
    ok_from = healthy_after if healthy_after is not None else 99
    _stub(
        bin_dir / "ray",
        f'echo "$*" >> {calls}\n[ "$(wc -l < {calls})" -ge {ok_from} ]\n',
    )
    _stub(bin_dir / "pdserve", f'printf "%s\\n" "$@" > {tmp_path / "pdserve_argv"}\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run(
        ["/bin/bash", "-c", router_script(objs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    checks = calls.read_text().splitlines()
    assert set(checks) == {"health-check --address 127.0.0.1:6379"}
    if healthy_after is None:
        assert r.returncode == 1 and len(checks) == 3
        assert "no Ray head at 127.0.0.1:6379 after 3 checks" in r.stderr
        assert not (tmp_path / "pdserve_argv").exists()
    else:
        assert r.returncode == 0 and len(checks) == healthy_after, r.stderr
        assert (tmp_path / "pdserve_argv").read_text().split() == [
            "serve", "--config", "/etc/pdserve/config.yaml", "--ray-address", "auto",
            "--host", "0.0.0.0", "--port", "8000",
        ]  # fmt: skip


def test_service_selects_the_head_pod_only(helm: str) -> None:
    """The router Service's selector matches the head pod's labels (as rendered, which are
    the ones KubeRay sets) and no worker pod's, and targets the router's http port."""
    objs = render(helm, "service.annotations.team=llm", "service.type=LoadBalancer")
    svc = one(objs, "Service")
    selector = svc["spec"]["selector"]
    assert selector == {"ray.io/cluster": FULLNAME, "ray.io/node-type": "head"}
    assert selector.items() <= head_pod(objs)["metadata"]["labels"].items()
    for name, grp in groups(objs).items():
        assert not selector.items() <= grp["template"]["metadata"]["labels"].items(), name
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["annotations"] == {"team": "llm"}
    assert one(render(helm), "Service")["spec"]["type"] == "ClusterIP"


def ray_auth_env(c: dict) -> dict[str, dict]:
    """A container's RAY_AUTH_* env entries by name (each name set once)."""
    names = [e["name"] for e in c.get("env", [])]
    assert len(names) == len(set(names)), f"{c['name']}: env names repeat: {names}"
    return {e["name"]: e for e in c.get("env", []) if e["name"].startswith("RAY_AUTH")}


@pytest.mark.parametrize(
    ("sets", "mode", "secret"),
    [
        ((), "token", RAY_TOKEN_SECRET),
        (("rayAuth.existingSecret=mine",), "token", "mine"),
        (("rayAuth.mode=disabled",), "disabled", None),
    ],
    ids=["token", "existing-secret", "disabled"],
)
def test_ray_auth_on_every_container(helm: str, sets: tuple, mode: str, secret: str | None) -> None:
    """authOptions tells KubeRay the mode and Secret; every container of every pod (the
    router above all, which KubeRay does not touch) gets RAY_AUTH_MODE and, in token mode,
    RAY_AUTH_TOKEN from that Secret, next to the user's own env."""
    user_env = ("head.env[0].name=A", "head.env[0].value=a", "decode.env[0].name=B")
    objs = render(helm, *sets, *user_env, "decode.env[0].value=b")
    auth = one(objs, "RayCluster")["spec"]["authOptions"]
    assert auth == ({"mode": mode, "secretName": secret} if secret else {"mode": mode})
    expect = {"RAY_AUTH_MODE": {"name": "RAY_AUTH_MODE", "value": mode}}
    if secret:
        ref = {"secretKeyRef": {"name": secret, "key": "auth_token"}}
        expect["RAY_AUTH_TOKEN"] = {"name": "RAY_AUTH_TOKEN", "valueFrom": ref}
    pods = pod_templates(objs)
    assert sorted(pods) == ["decode", "head", "prefill", "tier"]
    assert [c["name"] for c in pods["head"]["spec"]["containers"]] == ["ray-head", "router"]
    for name, pod in pods.items():
        for c in pod["spec"]["containers"]:
            assert ray_auth_env(c) == expect, f"{name}/{c['name']}"
    assert all("A" in {e["name"] for e in c["env"]} for c in pods["head"]["spec"]["containers"])
    assert "B" in {e["name"] for e in pods["decode"]["spec"]["containers"][0]["env"]}
    made = [o["metadata"]["name"] for o in objs.get("Secret", [])]
    assert made == ([RAY_TOKEN_SECRET] if secret == RAY_TOKEN_SECRET else [])


def test_the_head_starts_no_idle_ray_workers_for_the_router(helm: str) -> None:
    """The router's driver connects to the head's raylet, which by default starts one idle
    Python worker a CPU for a first driver (never used: each pdserve actor takes a process
    of its own); the Ray container of the head turns that off, and only it (worker pods
    have no driver)."""
    pods = pod_templates(render(helm))
    off = {"name": "RAY_prestart_worker_first_driver", "value": "0"}
    assert off in container(pods["head"], "ray-head")["env"]
    others = [c for p in pods.values() for c in p["spec"]["containers"] if c["name"] != "ray-head"]
    assert others and not [c["name"] for c in others if off in c.get("env", [])]


def notes(helm: str, *sets: str) -> str:
    """The NOTES `helm install` prints (a client-side dry run needs no cluster)."""
    cmd = [helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "KUBECONFIG": os.devnull}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("NOTES:", 1)[1]


def test_notes(helm: str) -> None:
    """NOTES say where the API, the dashboard and the metrics are, and where the Ray token
    is (or that Ray authentication is off)."""
    text = notes(helm)
    for part in (f"svc/{FULLNAME} 8000:8000", "/v1/chat/completions", "/dashboard", "/metrics"):
        assert part in text
    assert f"get secret {RAY_TOKEN_SECRET} -o jsonpath='{{.data.auth_token}}'" in text
    assert "get secret mine " in notes(helm, "rayAuth.existingSecret=mine")
    text = notes(helm, "rayAuth.mode=disabled")
    assert "Ray token authentication is disabled" in text and "auth_token" not in text
