#!/usr/bin/env bash
# A/B of benchmarks/transfer.py between two trees in one device call (host speed differs
# between machines, so only same-call numbers compare). Set-up as for ab_run.sh:
#   rm -rf ab_old && mkdir ab_old && git archive <old sha> | tar -x -C ab_old
# Device call (carry .gpu and ab_old):
#   OLD=<sha> NEW=<sha> ROUNDS=2 TRANSPORTS=cuda_ipc [LAYOUTS=paged_gqa] bash benchmarks/transfer_ab.sh
# Runs NEW then OLD, ROUNDS times; one line per case; JSON under $OUT/<side><round>/.
set -o pipefail
export PYTHONUNBUFFERED=1
source benchmarks/pdserve_tree.sh
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
for round in $(seq "${ROUNDS:-2}"); do
  for side in new old; do
    root=$PWD; commit=${NEW:-new}
    if [ $side = old ]; then root=$PWD/ab_old; commit=${OLD:-old}; fi
    pdserve_tree "$root" /tmp/pk_$side
    out="$OUT/$side$round"; mkdir -p "$out"
    (cd "$root" && PDSERVE_COMMIT=$commit PYTHONPATH=/tmp/pk_$side:/tmp/site timeout 150 \
      python3 benchmarks/transfer.py --transports "${TRANSPORTS:-cuda_ipc}" --reps "${REPS:-50}" \
      --layouts "${LAYOUTS:-paged_gqa,hybrid}" \
      --out "$out" > "$out.log" 2>&1)
    python3 - "$out" "$side$round" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("transfer_*.json")):
    for r in json.loads(f.read_text()):
        print(sys.argv[2], r["transport"], r["tokens"], "of_copy", round(r["GBps"] / r["baseline_GBps"], 3),
              "lat_ms", round(r["latency_ms"], 4), "host_ms", round(r.get("host_ms") or 0, 4),
              "dev_ms", round(r.get("device_ms") or 0, 4), "base_dev_ms", round(r.get("baseline_device_ms") or 0, 4))
PY
  done
done
