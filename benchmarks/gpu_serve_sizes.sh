#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): the explicit KV sizes and engine flags of
# `pdserve serve` on the GPU path. A check, not a benchmark: it prints what it saw.
#   - `--kv-cache-memory-bytes 4G --max-model-len 8k` (PD, two workers sharing the GPU):
#     each worker's blocks and engine settings from /ops/pools, and a greedy completion;
#   - `--kv-cache-memory-bytes 100G`: two workers cannot both hold it beside their weights
#     on one H200, so serve must refuse it at start, naming the sizes;
#   - `--no-enable-chunked-prefill --no-async-scheduling --enforce-eager` with an empty
#     Triton cache: the settings the workers report, a completion, then 48 concurrent
#     requests of 1-100 prompt tokens and six of 300-340 (decode batches of every size up
#     to 48 rows, long contexts split), and
#     the kernels the workers compiled while serving (the warm-up should leave none).
source benchmarks/gpu_serve_setup.sh

serve_check() {  # $1 name, $2 port, then serve flags
  local name=$1 port=$2
  if serve_up "$@"; then
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
    python3 - "$port" <<'PY'
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
url = f"http://127.0.0.1:{sys.argv[1]}/v1/completions"
def ask(i):
    n = 300 + i if i % 8 == 0 else 1 + (i * 37) % 100  # a few past 256 keys: split decodes
    body = {"prompt": [(31 * i + j) % 1000 + 3 for j in range(n)],
            "temperature": 0, "max_tokens": 8 + i % 24, "ignore_eos": True}
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["usage"]["completion_tokens"]
with ThreadPoolExecutor(48) as pool:
    got = list(pool.map(ask, range(48)))
print("48 concurrent requests:", sum(got), "tokens; all full:", got == [8 + i % 24 for i in range(48)])
PY
    curl -s "localhost:$port/metrics" | grep -E "^pdserve:worker_kernel_compiles"
    grep "while serving" "$OUT/serve_$name.log" | head -5
  fi
  serve_down "$name"
}

serve_check sized 8310 --kv-cache-memory-bytes 4G --max-model-len 8k
echo "== too big: pdserve serve /tmp/pdserve-model --kv-cache-memory-bytes 100G"
timeout 300 python3 -m pdserve.cli serve /tmp/pdserve-model --port 8311 \
  --kv-cache-memory-bytes 100G > "$OUT/serve_too_big.log" 2>&1
echo "exit $?"; tail -3 "$OUT/serve_too_big.log"
TRITON_CACHE_DIR=$(mktemp -d) serve_check unchunked 8312 --no-enable-chunked-prefill \
  --no-async-scheduling --enforce-eager
