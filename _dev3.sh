set -o pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
source benchmarks/pdserve_tree.sh && pdserve_tree "$PWD" /tmp/pdpkg
export PYTHONPATH=/tmp/pdpkg:/tmp/site PDSERVE_COMMIT=$(git log -1 --format=%h) PYTHONUNBUFFERED=1
cd benchmarks
timeout 400 python3 int_linear_bench.py --shapes llama3_8b --gemms gate_up,o --rows 1,32,2048 --sweep --out $OUT > $OUT/sweep.log 2>&1
tail -5 $OUT/sweep.log
