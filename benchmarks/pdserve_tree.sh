# Sourced by the device scripts: `pdserve_tree ROOT DEST` makes DEST/pdserve an importable
# package of the tree at ROOT (its top-level modules copied, its subpackages linked), for
# PYTHONPATH=DEST. The image's setuptools editable install does not always map
# package-dir, and A/B runs need two trees importable side by side.
pdserve_tree() {
  rm -rf "$2" && mkdir -p "$2/pdserve" && cp "$1"/pdserve/*.py "$2/pdserve/"
  for d in runner kernels kvtransfer prefill decode cluster; do ln -sfn "$1/$d" "$2/pdserve/$d"; done
}
