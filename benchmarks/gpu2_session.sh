#!/usr/bin/env bash
# One device call on the two-GPU kind (nvidia-h200-x2), from the repo root with `.gpu`
# carried (see gpu_session.sh for the bundle): the two-GPU tests, the transfer between
# GPUs, and PD vs colocated. Every stage writes into $OUT and has its own time limit, so a
# stage that hangs leaves the others' results.
#   STAGES=tests,transfer,pd (default all)   RATES=2,4,8,16   PROMPTS=48
#   MODES=pd,pd-cond,colocated   TRANSPORT=cuda_ipc   PD_TIMEOUT=420
#   REPS=20 (timed pulls per transfer case)   PROFILE_PULLS=0 (cProfile N pulls per case)
#   COND_TOKENS=16384 (pd-cond's prefill queue threshold)
set -o pipefail
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT"
R=$PWD
BENCH=none TESTS=0 bash benchmarks/gpu_session.sh > "$OUT/setup.log" 2>&1
export PYTHONPATH=/tmp/pdpkg:/tmp/site PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
STAGES=${STAGES:-tests,transfer,pd}
if [[ ,$STAGES, == *,tests,* ]]; then
  PDSERVE_TEST_DEVICE=cuda timeout 150 python3 -P -m pytest -q -p no:cacheprovider \
      tests/test_gpu_peer_ipc.py tests/test_gpu_cuda_ipc.py > "$OUT/gpu2_tests.log" 2>&1
  tail -2 "$OUT/gpu2_tests.log"
fi
if [[ ,$STAGES, == *,transfer,* ]]; then
  timeout 170 python3 benchmarks/transfer.py --transports cuda_ipc_peer,nccl --hang-dump-s 150 \
      --reps ${REPS:-20} --profile-pulls ${PROFILE_PULLS:-0} \
      --out "$OUT" > "$OUT/transfer.log" 2>&1
  grep '^{' "$OUT/transfer.log" | cut -c1-160
fi
if [[ ,$STAGES, == *,pd,* ]]; then
  python3 benchmarks/synthetic_model.py /tmp/pdserve-model > "$OUT/model.log" 2>&1
  # Not from the repo root: its pdserve/ would shadow /tmp/pdpkg in the serve child.
  (cd /tmp && timeout "${PD_TIMEOUT:-420}" python3 "$R/benchmarks/pd_vs_colocated.py" \
      --model /tmp/pdserve-model --workers 2 --modes "${MODES:-pd,pd-cond,colocated}" \
      --rates "${RATES:-2,4,8,16}" --num-prompts "${PROMPTS:-48}" --out "$OUT" \
      --cond-tokens "${COND_TOKENS:-16384}" \
      --serve-args "--kv-transport ${TRANSPORT:-cuda_ipc} --max-model-len 8704 --max-num-seqs 256" \
      2>&1 | grep -v "req/s\]" | tail -15)
  tar czf "$OUT/serve_logs.tgz" /tmp/pd-vs-colocated-* 2>/dev/null
fi
