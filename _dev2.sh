set -o pipefail
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
source benchmarks/pdserve_tree.sh && pdserve_tree "$PWD" /tmp/pdpkg
export PYTHONPATH=/tmp/pdpkg:/tmp/site PDSERVE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo x) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/tests.log
(cd /tmp && PDSERVE_TEST_DEVICE=cuda timeout 170 python3 -P -m pytest -q -p no:cacheprovider --rootdir $ROOT -c $ROOT/pyproject.toml $ROOT/tests/test_int_linear.py $ROOT/tests/test_packed_int_checkpoints.py -x --tb=short 2>&1 | tail -40 >> $OUT/tests.log)
cd benchmarks
timeout 120 python3 int_linear_bench.py --shapes llama3_8b --out $OUT > $OUT/bench.log 2>&1
timeout 40 python3 int_linear_bench.py --shapes qwen3_0_6b --rows 1,32,2048 --out $OUT >> $OUT/bench.log 2>&1
timeout 130 python3 model_throughput.py --shape llama3_8b --out $OUT > $OUT/mt.log 2>&1
timeout 130 python3 model_throughput.py --shape llama3_8b --quantize gptq4 --out $OUT >> $OUT/mt.log 2>&1
ls $OUT
