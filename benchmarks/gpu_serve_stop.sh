#!/usr/bin/env bash
# One device call (`.gpu` carried): `pdserve run-batch` against a GPU server, then that
# server's SIGTERM drain. A check, not a benchmark: it prints what it saw. (Written on
# 2026-12-07 while no device was lent: not run on one yet.)
#   1. `pdserve serve MODEL --shutdown-timeout 3` (PD, CUDA graphs);
#   2. run-batch of 6 lines (completions by ids and by text, n=2, logprobs, one refused,
#      one malformed) against it:
#      the output lines, in order, with their status codes;
#   3. a short and a long completion and a long streamed one in flight, then SIGTERM:
#      the short one 200, the long one 503 "the server is shutting down", the stream an
#      error event and [DONE], the server's exit status 0 and how long it took.
source benchmarks/gpu_serve_setup.sh
PORT=8310
serve_up drain $PORT --shutdown-timeout 3 --max-model-len 32768 || exit 1
grep "pdserve:" "$OUT/serve_drain.log"

cat > "$OUT/batch_in.jsonl" <<'EOF'
{"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": true}}
{"custom_id": "c2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "t5 t6 t7", "max_tokens": 8, "temperature": 0, "ignore_eos": true}}
{"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": {"prompt": [9, 10], "max_tokens": 16, "temperature": 0, "ignore_eos": true, "n": 2}}
{"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5], "max_tokens": -1}}
{"custom_id": "c5", "method": "POST", "url": "/v1/completions", "body": {"prompt": [11, 12, 13], "max_tokens": 8, "temperature": 0, "logprobs": 2}}
not json
EOF
start=$(date +%s.%N)
python3 -m pdserve.cli run-batch -i "$OUT/batch_in.jsonl" -o "$OUT/batch_out.jsonl" \
  --base-url "http://localhost:$PORT" 2>&1 | tail -3
echo "run-batch exit ${PIPESTATUS[0]} in $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s"
python3 - "$OUT/batch_out.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    r, e = d.get("response") or {}, d.get("error")
    body = r.get("body") or {}
    texts = [c.get("text") or (c.get("message") or {}).get("content") for c in body.get("choices", [])]
    print(d["custom_id"], r.get("status_code"), e and e.get("code"), [len(t or "") for t in texts])
EOF

req() {  # $1 name, $2 max_tokens, $3 stream
  curl -s -m 120 "localhost:$PORT/v1/completions" -H 'content-type: application/json' \
    -d "{\"prompt\": [5, 6, 7], \"max_tokens\": $2, \"temperature\": 0, \"ignore_eos\": true, \"stream\": $3}" \
    -w '\nHTTP %{http_code}\n' > "$OUT/drain_$1.txt" 2>&1 &
}
req short 16 false
req long 30000 false
req stream 30000 true
sleep 1
t0=$(date +%s.%N)
kill -TERM $SERVE_PID
wait $SERVE_PID
echo "serve exit $? after $(python3 -c "print(round($(date +%s.%N) - $t0, 2))") s"
wait
for n in short long stream; do echo "== $n"; tail -c 300 "$OUT/drain_$n.txt"; echo; done
grep -c Traceback "$OUT/serve_drain.log" | sed 's/^/tracebacks in the serve log: /'
tail -4 "$OUT/serve_drain.log"
