"""Extract the ray.io/v1 RayCluster OpenAPI schema from KubeRay's CRD for the chart's tests.

The whole CRD (ray.io_rayclusters.yaml, ~0.9 MB, two versions) is too big to commit; the
tests need only `spec.versions[name=v1].schema.openAPIV3Schema`, written as compact JSON,
gzipped with a fixed mtime so that re-running on the same CRD gives the same bytes.

    python helm/extract_crd_schema.py path/to/ray.io_rayclusters.yaml
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import yaml

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests/data/raycluster_v1_schema.json.gz"


def extract(crd: dict, version: str = "v1") -> dict:
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"not a CustomResourceDefinition: kind {crd.get('kind')!r}")
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    names = [v["name"] for v in crd["spec"]["versions"]]
    raise ValueError(f"no version {version!r} in the CRD; it has {names}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("crd", type=Path, help="KubeRay's ray.io_rayclusters.yaml")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    schema = extract(yaml.load(args.crd.read_text(), Loader=loader))
    data = json.dumps(schema, separators=(",", ":"), sort_keys=True).encode()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
        gz.write(data)
    print(f"{args.out}: {len(data)} bytes of JSON, {args.out.stat().st_size} gzipped")


if __name__ == "__main__":
    main()
