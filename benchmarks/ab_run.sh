#!/usr/bin/env bash
# A/B throughput of two trees on one GPU machine in one device call (machines differ in
# host speed by up to 2x between calls, so only same-call comparisons are fair).
# Before the call, here:  rm -rf ab_old && mkdir ab_old && git archive <old sha> | tar -x -C ab_old
# Device call (carry .gpu and ab_old, which .gitignore keeps out of commits):  OLD=<old sha> NEW=<new sha> bash benchmarks/ab_run.sh
# Runs NEW, OLD, NEW again; prints one line per workload; JSON under $OUT/<side>/.
set -o pipefail
export PYTHONUNBUFFERED=1
WORKLOADS=${WORKLOADS:-small_batch,decode_heavy}
source benchmarks/pdserve_tree.sh
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
for side in new old new2; do
  root=$PWD; commit=${NEW:-new}
  if [ $side = old ]; then root=$PWD/ab_old; commit=${OLD:-old}; fi
  pdserve_tree "$root" /tmp/pk_$side
  mkdir -p "$OUT/$side"
  (cd "$root" && PDSERVE_COMMIT=$commit PYTHONPATH=/tmp/pk_$side:/tmp/site timeout 170 \
    python3 benchmarks/throughput.py --no-hf --workloads "$WORKLOADS" --out "$OUT/$side" 2>&1 \
    | tee "$OUT/$side.log" | grep '^{' | python3 -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    print('$side', d['workload'], round(d['output_tok_s']), round(d['tpot_p50_ms'], 3), round(d['cpu_ms_per_step'], 3))")
done
