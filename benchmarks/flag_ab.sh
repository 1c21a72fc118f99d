#!/usr/bin/env bash
# A/B of engine options on one tree in one device call (hosts differ by up to 2x between
# calls, so only same-call comparisons are fair): throughput.py once per variant and
# round, interleaved. A variant is a list of throughput.py flags; variants are separated
# by ';' and the empty variant is the defaults.
# Device call (carry .gpu):
#   PDSERVE_COMMIT=<sha> VARIANTS=";--cuda-graph-scope step;--decode-attention flat" \
#     ROUNDS=2 OUT=/tmp/o/ab bash benchmarks/flag_ab.sh
# (PDSERVE_COMMIT labels the JSON: a device copy's .git may lag the tree.)
# One line per run: variant, workload, output tok/s, TPOT p50 ms, host ms a step; the JSON
# under $OUT/v<i>_r<round>/.
set -o pipefail
export PYTHONUNBUFFERED=1
WORKLOADS=${WORKLOADS:-small_batch}
source benchmarks/pdserve_tree.sh
[ -d /tmp/site/zmq ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
pdserve_tree "$PWD" /tmp/pk_flag_ab
# Split on ';' keeping empty variants wherever they stand (`read -a` drops a trailing one:
# "--decode-attention per_head;" once ran one variant, not two).
variants=()
while IFS= read -r -d ';' v; do variants+=("$v"); done <<< "${VARIANTS:-;--cuda-graph-scope step};"
for round in $(seq "${ROUNDS:-2}"); do
  for i in "${!variants[@]}"; do
    read -r -a flags <<< "${variants[$i]}"
    out="$OUT/v${i}_r$round"; mkdir -p "$out"
    PYTHONPATH=/tmp/pk_flag_ab:/tmp/site timeout "${RUN_TIMEOUT:-170}" \
      python3 benchmarks/throughput.py --no-hf --workloads "$WORKLOADS" --out "$out" \
      "${flags[@]}" > "$out.log" 2>&1
    grep '^{' "$out.log" | VARIANT="${variants[$i]:-defaults}" python3 -c "
import json, os, sys
for line in sys.stdin:
    d = json.loads(line)
    print(repr(os.environ['VARIANT']), d['workload'], round(d['output_tok_s']),
          round(d['tpot_p50_ms'], 3), round(d['cpu_ms_per_step'], 3))" \
      || echo "${variants[$i]:-defaults} round $round: FAILED (see $out.log)"
  done
done
