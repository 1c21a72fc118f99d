# Sourced by the GPU serve checks (gpu_serve_ops.sh, gpu_serve_compat.sh) at the repo root
# of a device call: the GPU packages, the servable random model at /tmp/pdserve-model, the
# working directory /tmp (the repo root's pdserve/ would shadow /tmp/pdpkg),
# `wait_up PORT LOG [PID]` (a server's /health, 5 minutes at most; at once when PID ended),
# and `serve_up NAME PORT FLAGS...` / `serve_down NAME` (`pdserve serve` of that model,
# logged to $OUT/serve_NAME.log, in the background as $SERVE_PID; down is Ctrl-C).
set -o pipefail
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT"
BENCH=none TESTS=0 bash benchmarks/gpu_session.sh > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/pdpkg:/tmp/site PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
python3 benchmarks/synthetic_model.py /tmp/pdserve-model > "$OUT/model.log" 2>&1
cd /tmp || exit 1

wait_up() {  # $1 port, $2 log, $3 the server's pid (optional)
  for _ in $(seq 1 150); do
    curl -sf "localhost:$1/health" > /dev/null && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2> /dev/null; then
      echo "the server on $1 exited"; tail -30 "$2"; return 1
    fi
    sleep 2
  done
  echo "no health on $1"; tail -30 "$2"; return 1
}

serve_up() {  # $1 name, $2 port, then serve flags; 0 once it answers /health
  local name=$1 port=$2
  shift 2
  echo "== $name: pdserve serve /tmp/pdserve-model $*"
  timeout 400 python3 -m pdserve.cli serve /tmp/pdserve-model --port "$port" "$@" \
    > "$OUT/serve_$name.log" 2>&1 &
  SERVE_PID=$!
  wait_up "$port" "$OUT/serve_$name.log" $SERVE_PID
}

serve_down() {  # $1 name
  kill -INT $SERVE_PID 2> /dev/null; wait $SERVE_PID; echo "serve exit $?"
  tail -1 "$OUT/serve_$1.log"
}
