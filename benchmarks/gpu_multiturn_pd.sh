#!/usr/bin/env bash
# One device call (nvidia-h200, `.gpu` carried): PD multi-turn conversations with the
# prefix-hit threshold `--pd-min-prompt-tokens` at each value in $MINS (default "16 1024",
# $ROUNDS rounds interleaved, default 2). 16 sends every turn's uncached tail of more than
# 16 tokens to the prefill worker (a round trip and a KV pull); 1024 lets the decode
# worker compute tails of up to 1,023 tokens in its own batches, as Dynamo's conditional
# disaggregation does (its default local prefill length is ~1,000). A prefill worker and
# a decode worker share the GPU. Writes multiturn_pd_min<N>_r<R>_<device>.json under $OUT.
#   PDSERVE_COMMIT: the tree's commit, written into the results (the device copy's git may
#   lag the working tree)
#   MT_ARGS: multiturn.py's workload (default 32 conversations × 4 turns, 1,024-token
#   first prompts, 64-token turns, 64-token replies)
export PDSERVE_COMMIT=${PDSERVE_COMMIT:?name the tree's commit: PDSERVE_COMMIT=<hash>}
source benchmarks/gpu_serve_setup.sh
ROOT=$OLDPWD
MT_ARGS=${MT_ARGS:---conversations 32 --turns 4 --first-len 1024 --turn-len 64 --output-len 64}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for min in ${MINS:-16 1024}; do
    echo "== round $round, pd_min_prompt_tokens $min"
    # shellcheck disable=SC2086
    timeout 240 python3 "$ROOT/benchmarks/multiturn.py" --model /tmp/pdserve-model --mode pd \
      --workers 1 $MT_ARGS --serve-args "--pd-min-prompt-tokens $min" \
      --tag "pd_min${min}_r$round" --out "$OUT" 2>&1 | tail -2
  done
done
