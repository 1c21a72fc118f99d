set -o pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
source benchmarks/pdserve_tree.sh && pdserve_tree "$PWD" /tmp/pdpkg
export PYTHONPATH=/tmp/pdpkg:/tmp/site PDSERVE_COMMIT=f13ce25 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
cd benchmarks
timeout 230 python3 spec_decode_bench.py --profile 20 --sync-baseline --out $OUT 2>&1 | tail -120 > $OUT/spec.log
timeout 150 python3 model_throughput.py --shape granite4_h_tiny --out $OUT 2>&1 | tail -30 > $OUT/granite.log
timeout 180 python3 model_throughput.py --shape qwen3_next_80b --out $OUT 2>&1 | tail -30 > $OUT/qwen3next.log
ls $OUT
