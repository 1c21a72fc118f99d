#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): the serve log on the GPU path, and what
# the default KV transport does to a PD pair sharing the GPU. A check, not a benchmark.
# `pdserve serve MODEL` (PD, CUDA graphs) with `--log-stats-interval 2
# --enable-log-requests`, once per transport in $TRANSPORTS (default "tcp auto"; auto is
# cuda_ipc here), takes a streamed load from `pdserve bench` (64 random prompts of 512
# tokens, 128 output tokens, 16 at a time). For each it prints the bench summary, the
# pools' stats lines (the decode pool's steps should be graph steps), one request's lines,
# and the workers' token counters against the router's.
source benchmarks/gpu_serve_setup.sh
PORT=8310
for transport in ${TRANSPORTS:-tcp auto}; do
  LOG="$OUT/serve_$transport.log"
  echo "==== --kv-transport $transport"
  timeout 400 python3 -m pdserve.cli serve /tmp/pdserve-model --port $PORT \
    --kv-transport "$transport" --log-stats-interval 2 --enable-log-requests > "$LOG" 2>&1 &
  pid=$!
  if wait_up $PORT "$LOG" $pid; then
    grep "pdserve: serving" "$LOG"
    python3 -m pdserve.cli bench --base-url "http://127.0.0.1:$PORT" --num-prompts 64 \
      --input-len 512 --output-len 128 --max-concurrency 16 --seed 0 \
      --result-file "$OUT/bench_$transport.json" > "$OUT/bench_$transport.log" 2>&1
    tail -12 "$OUT/bench_$transport.log"
    sleep 5  # the pools' next lines, then their idle lines
    curl -s "localhost:$PORT/metrics" | grep -E \
      "^pdserve:(worker_generation_tokens|generation_tokens|worker_prompt_tokens_computed|prompt_tokens|engine_steps|kv_transfer_pulls|worker_kernel_compiles)_total" \
      > "$OUT/metrics_$transport.txt"
  fi
  kill -INT $pid; wait $pid; echo "serve exit $?"
  echo "== stats lines"
  grep " pool (" "$LOG"
  echo "== one request"
  first=$(grep -o "request cmpl-[0-9a-f]*: received" "$LOG" | head -1 | cut -d' ' -f2 | tr -d :)
  [ -n "$first" ] && grep "$first" "$LOG"
  echo "== requests logged: $(grep -c ': received ' "$LOG") received, $(grep -c ': finished ' "$LOG") finished"
  python3 - "$OUT/metrics_$transport.txt" <<'EOF'
import sys
total = {}
for line in open(sys.argv[1]):
    name, value = line.rsplit(" ", 1)
    key = name.split("{")[0]
    if "kv_transfer_pulls" in key or "kernel_compiles" in key:
        print(line.strip())
    total[key] = total.get(key, 0.0) + float(value)
print("workers' sampled tokens", total.get("pdserve:worker_generation_tokens_total"),
      "router's output tokens", total.get("pdserve:generation_tokens_total"))
EOF
done
