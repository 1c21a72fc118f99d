#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): `pdserve serve` on the GPU the two ways it
# places workers, with the ops endpoints. A check, not a benchmark: it prints what it saw
# and writes the /ops/pools answers into $OUT.
#   1. local Ray (the default): 1 prefill + 1 decode worker sharing the GPU; a completion;
#      /ops/pools; scaling refused (workers sharing a GPU keep their count); Ctrl-C.
#   2. a running Ray head with the GPU and pdserve_decode (as a chart's decode pod has):
#      `--ray-address --pool-resources --mode colocated`; a completion; Ctrl-C; the head
#      still up with its GPU free.
#   PARTS=local,joined (default both)
source benchmarks/gpu_serve_setup.sh
PROMPT=$(python3 -c "print(' '.join(f't{i}' for i in range(100, 140)))")
complete() {  # $1 port
  curl -s -m 60 "localhost:$1/v1/completions" -H 'content-type: application/json' \
    -d "{\"prompt\": \"$PROMPT\", \"max_tokens\": 8, \"temperature\": 0}" | cut -c1-300; echo
}

PARTS=${PARTS:-local,joined}
if [[ ,$PARTS, == *,local,* ]]; then
echo "== local"
timeout 400 python3 -m pdserve.cli serve --model /tmp/pdserve-model --port 8200 \
  > "$OUT/serve_local.log" 2>&1 &
pid=$!
if wait_up 8200 "$OUT/serve_local.log"; then
  grep "pdserve:" "$OUT/serve_local.log"
  complete 8200
  curl -s localhost:8200/ops/pools > "$OUT/ops_pools_local.json"
  python3 -c "
import json; d=json.load(open('$OUT/ops_pools_local.json'))
print({r: (p['bounds'], [(w['worker_id'], w['state'], w.get('num_blocks')) for w in p['workers']]) for r, p in d['pools'].items()}, d['decisions'])"
  curl -s -XPOST localhost:8200/ops/scale -d '{"role": "decode", "replicas": 2}'; echo
  curl -s localhost:8200/metrics | grep -E "engine_steps_total.*decode" | head -3
fi
kill -INT $pid; wait $pid; echo "serve exit $?"; tail -1 "$OUT/serve_local.log"
fi
[[ ,$PARTS, == *,joined,* ]] || exit 0

echo "== joined"
python3 -m ray.scripts.scripts start --head --port=6399 --num-gpus=1 --num-cpus=8 --resources='{"pdserve_decode": 1}' \
  --include-dashboard=false --temp-dir=/tmp/rayj --block > "$OUT/ray_head.log" 2>&1 &
head=$!
sleep 15
timeout 400 python3 -m pdserve.cli serve --model /tmp/pdserve-model --port 8201 \
  --ray-address 127.0.0.1:6399 --pool-resources --mode colocated > "$OUT/serve_joined.log" 2>&1 &
pid=$!
if wait_up 8201 "$OUT/serve_joined.log"; then
  grep "pdserve:" "$OUT/serve_joined.log"
  complete 8201
  curl -s localhost:8201/metrics | grep -E "engine_steps_total.*decode|kv_cache_usage" | head -4
fi
kill -INT $pid; wait $pid; echo "serve exit $?"; tail -1 "$OUT/serve_joined.log"
[ -f ~/.ray/auth_token ] && export RAY_AUTH_MODE=token  # `ray start` turned token auth on
python3 -c "
import ray; ray.init(address='127.0.0.1:6399', logging_level='ERROR')
r = ray.available_resources(); print('head free after stop:', {k: r.get(k) for k in ('GPU', 'pdserve_decode')})"
kill -TERM $head; wait $head
