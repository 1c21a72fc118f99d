#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): the vLLM-style serving surface on the GPU
# path. A check, not a benchmark: it prints what it saw and writes the answers into $OUT.
# The same requests go to `pdserve serve MODEL` (PD, CUDA graphs) and to the same command
# with `--enforce-eager`:
#   - lm-eval's loglikelihood payload (two token-id prompts, echo, logprobs 1, max_tokens 1),
#     which PD prefills on the decode worker;
#   - a 32-token greedy chat-less completion;
#   - /metrics: which paths ran the decode steps (eager only with --enforce-eager), and
#     the pd_decisions.
# Then a Python step reads both answers: the same greedy text?, and the prompt logprobs'
# largest difference.
source benchmarks/gpu_serve_setup.sh
IDS=$(python3 -c "print([[i for i in range(100 + 7 * p, 160 + 7 * p)] for p in range(2)])")

run_one() {  # $1 name, $2 port, then serve flags
  local name=$1 port=$2
  if serve_up "$@"; then
    grep "pdserve:" "$OUT/serve_$name.log"
    curl -s -m 120 "localhost:$port/v1/completions" -H 'content-type: application/json' \
      -d "{\"model\": \"/tmp/pdserve-model\", \"prompt\": $IDS, \"temperature\": 0, \"max_tokens\": 1, \"logprobs\": 1, \"echo\": true}" \
      > "$OUT/echo_$name.json"
    curl -s -m 120 "localhost:$port/v1/completions" -H 'content-type: application/json' \
      -d "{\"prompt\": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], \"temperature\": 0, \"max_tokens\": 32, \"ignore_eos\": true}" \
      > "$OUT/greedy_$name.json"
    curl -s "localhost:$port/metrics" | grep -E "engine_steps_total|pd_decisions_total" | tee "$OUT/metrics_$name.txt"
  fi
  serve_down "$name"
}

run_one graphs 8300
run_one eager 8301 --enforce-eager
python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
def load(kind, name):
    return json.load(open(f"{out}/{kind}_{name}.json"))
for name in ("graphs", "eager"):
    e = load("echo", name)
    print(name, "echo choices", [(c["index"], len(c["logprobs"]["token_logprobs"]),
          c["logprobs"]["token_logprobs"][0]) for c in e["choices"]], "usage", e["usage"])
g, e = load("greedy", "graphs"), load("greedy", "eager")
print("greedy text equal:", g["choices"][0]["text"] == e["choices"][0]["text"],
      "tokens", g["usage"]["completion_tokens"], e["usage"]["completion_tokens"])
diff = 0.0
for cg, ce in zip(load("echo", "graphs")["choices"], load("echo", "eager")["choices"]):
    a, b = cg["logprobs"]["token_logprobs"][1:-1], ce["logprobs"]["token_logprobs"][1:-1]
    diff = max(diff, max(abs(x - y) for x, y in zip(a, b)))
print("prompt logprobs, largest |graphs - eager|:", diff)
EOF
