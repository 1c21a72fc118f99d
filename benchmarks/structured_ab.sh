source benchmarks/pdserve_tree.sh
pdserve_tree "$PWD" /tmp/pd_new; pdserve_tree "$PWD/ab_old" /tmp/pd_old
for round in 1 2; do for tree in old new; do
  mkdir -p $OUT/$tree$round
  (cd benchmarks && PDSERVE_COMMIT=$([ $tree = old ] && echo 6e431fb || echo c1a39e2) PYTHONPATH=/tmp/pd_$tree:/tmp/site:$PWD timeout 200 python3 -P structured_overhead.py --tokenizer-dir ../ab_tok --out $OUT/$tree$round 2>&1 | grep -v "Loading\|Writing" | python3 -c "import sys,json
for l in sys.stdin:
  try: r=json.loads(l); print('$tree$round', r['variant'],r['temperature'],r['output_tok_s'],r['ms_per_token_step'])
  except Exception: print(l.rstrip()[:300])")
done; done
