#!/usr/bin/env bash
# One device call (see ../shared/GPU.md): benchmarks, then the GPU-path correctness tests.
# Run from the repo root on the GPU machine with `.gpu` carried
# (bash ../shared/tools/gpu-bundle.sh hypothesis sortedcontainers attrs fastapi uvicorn
#  starlette pydantic pydantic-core annotated-types typing-inspection anyio sniffio h11 click
#  typing-extensions opentelemetry-api importlib-metadata zipp: the last ones for
#  `pdserve serve`; fastapi 0.165 imports opentelemetry).
#   BENCH=throughput|transfer|both|moe|none (default both)   BENCH_ARGS=...   TESTS=0 to skip tests
#   (moe: benchmarks/moe_bench.py, the MoE experts' kernels, with MOE_ARGS=...)
#   TESTS=1 / 2 / 3 / 4 runs the first / second / third / fourth group of the GPU test files
#   (the whole set takes more test time than a call can give it after the set-up and a
#   benchmark: the groups fit a call each, each with its own summary line); TEST_FILES="a b"
#   runs just those files; PYTEST_ARGS adds pytest options ("-v --tb=line": each test's
#   outcome as it ends, so a run cut by its timeout still names what failed); KEYWORDS
#   narrows the selection (a pytest -k expression, joined to the script's own: a -k in
#   PYTEST_ARGS would be replaced by it, as pytest keeps the last -k)
set -o pipefail
OUT=${OUT:-/tmp/pdserve-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
# Ray (slim) for `pdserve serve` and the PD benchmarks.
[ -d /tmp/site/ray ] || tar xJf .gpu/ray-*-slim.tar.xz -C /tmp/site
# The slim tarball comes from an unzipped wheel, which drops the executable bits.
chmod +x /tmp/site/ray/core/src/ray/gcs/gcs_server /tmp/site/ray/core/src/ray/raylet/raylet
export RAY_USAGE_STATS_ENABLED=0
# The image's setuptools editable install does not always map package-dir; a symlink
# tree gives the same import names without touching the image.
source benchmarks/pdserve_tree.sh
pdserve_tree "$PWD" /tmp/pdpkg
export PYTHONPATH=/tmp/pdpkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# A device copy's .git may lag the working tree: the caller names the commit.
export PDSERVE_COMMIT=${PDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BENCH=${BENCH:-both}
if [ "$BENCH" = throughput ] || [ "$BENCH" = both ]; then
  timeout "${BENCH_TIMEOUT:-190}" python3 benchmarks/throughput.py ${BENCH_ARGS:---no-hf} --out "$OUT" 2>&1 | tee "$OUT/bench.log"
fi
if [ "$BENCH" = transfer ] || [ "$BENCH" = both ]; then
  timeout "${TRANSFER_TIMEOUT:-120}" python3 benchmarks/transfer.py --transports tcp,local,cuda_ipc --out "$OUT" 2>&1 | tee "$OUT/transfer.log"
fi
if [ "$BENCH" = moe ]; then
  timeout "${MOE_TIMEOUT:-240}" python3 benchmarks/moe_bench.py ${MOE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/moe_bench.log"
fi
[ "${TESTS:-all}" = 0 ] && exit 0
# -P: the repo root must not shadow /tmp/pdpkg's pdserve (the root's pdserve/ lacks the
# subpackages). SmolLM2 tests need the 98 MB wheel, which does not fit the carry limit.
FIRST=(tests/test_gpu_step_loop.py tests/test_gpu_attention.py tests/test_gpu_kernels.py
    tests/test_gpu_cuda_ipc.py tests/test_gpu_copy_stream.py tests/test_pd_engine.py tests/test_qkv_prep.py
    tests/test_qkv_attend.py
    tests/test_kv_copy_kernel.py tests/test_copy_graph.py tests/test_kv_pack.py tests/test_decode_prep.py
    tests/test_triton_index_kernels.py tests/test_tier_actor.py tests/test_gpu_tier_write_behind.py
    tests/test_compile_watch.py tests/test_gpu_compile_watch.py)
SECOND=(tests/test_paged_attention_triton.py tests/test_skinny_linear.py
    tests/test_parity_hf.py tests/test_self_consistency.py tests/test_async_scheduling.py
    tests/test_layer_wise.py tests/test_norm_fold.py tests/test_gpu_norm_fold.py
    tests/test_sampling_triton.py tests/test_grammar_kernels.py tests/test_structured_tiny.py
    tests/test_moe_kernels.py tests/test_gpu_moe.py tests/test_moe_grouped.py tests/test_moe_models.py tests/test_mla.py
    tests/test_gpu_mla.py tests/test_moe_relu2_experts.py)
# The families and kernel features of the 2026-12-05 sessions (windows, softcaps, sinks,
# Gemma, gpt-oss, FP8/MXFP4 checkpoints, hybrids, the FP8 KV cache, Qwen3-Next).
THIRD=(tests/test_sliding_window_attention.py tests/test_sliding_window_models.py
    tests/test_gemma.py tests/test_triton_layer_kernels.py tests/test_softcap_attention.py
    tests/test_fp8_checkpoints.py tests/test_longrope.py tests/test_gemma_norm.py
    tests/test_attention_sinks.py tests/test_moe_oai_experts.py tests/test_gpt_oss.py
    tests/test_text_only_checkpoints.py tests/test_ministral3.py tests/test_post_norm_models.py
    tests/test_llama_variants.py tests/test_lora.py tests/test_lora_kernels.py
    tests/test_embeddings.py tests/test_classify.py tests/test_mamba_hybrid.py
    tests/test_mamba_pd.py tests/test_lora_hybrid.py tests/test_fp8_kv_cache.py
    tests/test_gpu_hybrid_graphs.py tests/test_ssm_update.py tests/test_delta_rule_update.py
    tests/test_qwen3_next.py tests/test_hybrid_prefix_caching.py)
# The 2026-12-05 thirty-fifth session's kernels and families (no device was lent then):
# the Mamba1 scan and the new models (chunked attention's kernel cases are in THIRD's
# test_sliding_window_attention.py); the packed integer and kept FP8 linears.
FOURTH=(tests/test_selective_scan.py
    tests/test_llama4.py tests/test_qwen_vl_text.py tests/test_minimax_m2.py
    tests/test_cohere.py tests/test_weights_fit.py tests/test_glm4.py
    tests/test_ernie4_5_moe.py tests/test_olmoe.py tests/test_granite_moe.py tests/test_arcee.py
    tests/test_int_linear.py tests/test_packed_int_checkpoints.py tests/test_moe_int.py tests/test_fp8_linear.py
    tests/test_fp8_quant.py tests/test_fp8_gemm.py tests/test_fp8_online.py)
case "${TESTS:-all}" in
  1) FILES=("${FIRST[@]}") ;;
  2) FILES=("${SECOND[@]}") ;;
  3) FILES=("${THIRD[@]}") ;;
  4) FILES=("${FOURTH[@]}") ;;
  *) FILES=("${FIRST[@]}" "${SECOND[@]}" "${THIRD[@]}" "${FOURTH[@]}") ;;
esac
[ -n "${TEST_FILES:-}" ] && read -r -a FILES <<< "$TEST_FILES"
# From /tmp: Ray's workers (the tier actor tests) put the driver's working directory on
# their path, and the repo root's pdserve/ would shadow /tmp/pdpkg's there too.
ROOT=$PWD
SELECT="not smollm2 and not bundled and not stop_strings"
[ -n "${KEYWORDS:-}" ] && SELECT="($KEYWORDS) and $SELECT"
cd /tmp && PDSERVE_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-360}" python3 -P -m pytest -q \
    -p no:cacheprovider ${PYTEST_ARGS:-} --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "${FILES[@]/#/$ROOT/}" \
    -k "$SELECT" 2>&1 | tee "$OUT/gpu_tests.log"
