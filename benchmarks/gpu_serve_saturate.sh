#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): `pdserve serve` (PD, one GPU) past its
# decode pool's slots, with the router's queue at its default and in effect switched off,
# so the two can be compared. `--max-num-seqs 64` gives the decode worker 128 slots by
# default (64 running, 64 waiting, cluster/decode_admission.py); `pdserve bench` keeps
# CONCURRENCY (default 256) random prompts of 512 tokens (128 output) in flight, so about
# half wait in the router. "unbounded" lets every request straight onto the worker (the
# behaviour before the queue). MAX_NUM_SEQS, PROMPTS, OUTPUT_LEN change the shape (a
# small MAX_NUM_SEQS with long outputs makes the decode worker, not the prefill worker
# sharing its GPU, the bottleneck, so the cap binds). Writes
# $OUT/bench_<round>_<variant>.json and the pools' last lines.
source benchmarks/gpu_serve_setup.sh
PORT=8320
CONCURRENCY=${CONCURRENCY:-256}
round=0
for variant in ${VARIANTS:-default unbounded default unbounded}; do
  round=$((round + 1))
  extra=()
  [ "$variant" = unbounded ] && extra=(--max-waiting-per-decode-worker 1000000)
  LOG="$OUT/serve_${round}_$variant.log"
  echo "==== $variant ${extra[*]}"
  timeout 300 python3 -m pdserve.cli serve /tmp/pdserve-model --port $PORT --max-num-seqs "${MAX_NUM_SEQS:-64}" \
    --log-stats-interval 2 "${extra[@]}" > "$LOG" 2>&1 &
  pid=$!
  if wait_up $PORT "$LOG" $pid; then
    python3 -m pdserve.cli bench --base-url "http://127.0.0.1:$PORT" --num-prompts "${PROMPTS:-768}" \
      --input-len 512 --output-len "${OUTPUT_LEN:-128}" --max-concurrency "$CONCURRENCY" --seed 0 \
      --result-file "$OUT/bench_${round}_$variant.json" > "$OUT/bench_${round}_$variant.log" 2>&1
    tail -12 "$OUT/bench_${round}_$variant.log"
  fi
  kill -INT $pid; wait $pid; echo "serve exit $?"
  grep "decode pool" "$LOG" | grep -v "Running: 0 reqs" | tail -4
done
