#!/usr/bin/env bash
# A/B of the 32-row decode forward (benchmarks/decode_graph.py: the decode graph replayed
# back to back, host out of the loop, ~±0.005 ms) between trees and decode attention
# kernels, in one device call. Set-up here, one folder per extra tree (git-ignored names):
#   rm -rf ab_old && mkdir ab_old && git archive <sha or branch> | tar -x -C ab_old
# Device call (carry .gpu and the tree folders):
#   TREES=". ab_old" ATTN="per_head packed" bash benchmarks/decode_graph_ab.sh
# Each (tree, kernel) runs ROUNDS times (default 2), interleaved; one line each; JSON under
# $OUT/<tree>_<kernel><round>/. A tree older than f53311a has no --decode-attention: use
# ATTN=auto for it.
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/pdserve_tree.sh
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
for round in $(seq "${ROUNDS:-2}"); do
  for tree in ${TREES:-.}; do
    root=$(cd "$tree" && pwd); name=$(basename "$root")
    pdserve_tree "$root" "/tmp/pk_$name"
    for attn in ${ATTN:-per_head packed}; do
      out="$OUT/${name}_$attn$round"; mkdir -p "$out"
      flag=(); [ "$attn" = auto ] || flag=(--decode-attention "$attn")
      (cd "$root" && PDSERVE_COMMIT=$name PYTHONPATH=/tmp/pk_$name:/tmp/site:$root/benchmarks \
        timeout 170 python3 -P benchmarks/decode_graph.py "${flag[@]}" --out "$out" \
        > "$out.log" 2>&1)
      line=$(grep '^{' "$out.log" | tail -1)
      echo "$name $attn round $round: ${line:-FAILED (see $out.log)}" | cut -c1-400
    done
  done
done
