# Sourced by the GPU serve checks (gpu_serve_ops.sh, gpu_serve_compat.sh) at the repo root
# of a device call: the GPU packages, the servable random model at /tmp/pdserve-model, the
# working directory /tmp (the repo root's pdserve/ would shadow /tmp/pdpkg), and
# `wait_up PORT LOG [PID]` (a server's /health, 5 minutes at most; at once when PID ended).
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
