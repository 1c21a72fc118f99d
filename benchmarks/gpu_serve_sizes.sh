#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): the explicit KV sizes and engine flags of
# `pdserve serve` on the GPU path. A check, not a benchmark: it prints what it saw.
#   - `--kv-cache-memory-bytes 4G --max-model-len 8k` (PD, two workers sharing the GPU):
#     each worker's blocks and engine settings from /ops/pools, and a greedy completion;
#   - `--kv-cache-memory-bytes 100G`: two workers cannot both hold it beside their weights
#     on one H200, so serve must refuse it at start, naming the sizes;
#   - `--no-enable-chunked-prefill --no-async-scheduling --enforce-eager`: the settings the
#     workers report, and a completion.
source benchmarks/gpu_serve_setup.sh

serve_check() {  # $1 name, $2 port, then serve flags
  local name=$1 port=$2
  shift 2
  echo "== $name: pdserve serve /tmp/pdserve-model $*"
  timeout 400 python3 -m pdserve.cli serve /tmp/pdserve-model --port "$port" "$@" \
    > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  if wait_up "$port" "$OUT/serve_$name.log" $pid; then
    grep "pdserve:" "$OUT/serve_$name.log"
    curl -s "localhost:$port/ops/pools" > "$OUT/pools_$name.json"
    python3 - "$OUT/pools_$name.json" <<'PY'
import json, sys
pools = json.load(open(sys.argv[1]))["pools"]
for role in ("prefill", "decode"):
    for w in pools[role]["workers"]:
        s = w["startup"]
        print(role, w["worker_id"], "blocks", w["num_blocks"], "kv_bytes", s.get("kv_bytes"),
              "engine", s.get("engine"))
PY
    curl -s -m 120 "localhost:$port/v1/completions" -H 'content-type: application/json' \
      -d '{"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], "temperature": 0, "max_tokens": 16, "ignore_eos": true}' \
      | tee "$OUT/greedy_$name.json"
    echo
  fi
  kill -INT $pid 2> /dev/null; wait $pid; echo "serve exit $?"; tail -2 "$OUT/serve_$name.log"
}

serve_check sized 8310 --kv-cache-memory-bytes 4G --max-model-len 8k
echo "== too big: pdserve serve /tmp/pdserve-model --kv-cache-memory-bytes 100G"
timeout 300 python3 -m pdserve.cli serve /tmp/pdserve-model --port 8311 \
  --kv-cache-memory-bytes 100G > "$OUT/serve_too_big.log" 2>&1
echo "exit $?"; tail -3 "$OUT/serve_too_big.log"
serve_check unchunked 8312 --no-enable-chunked-prefill --no-async-scheduling --enforce-eager
