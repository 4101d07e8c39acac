# The second GPU check: the tests after the fixes, then three benches. Outputs to $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_exactness.py tests/test_lean.py tests/test_eagle.py 2>&1 | tail -8 | tee $OUT/pytest.txt
timeout 40 python3 .gpu/make_random.py /tmp/models 2>&1 | grep params
M=/tmp/models
timeout 120 python3 -m specdec.cli bench --device cuda --peers hf,hf-lookup --pair $M/smollm2-135m-random --workload .gpu/spec_bench_dev.jsonl --quick --repeats 2 --out /tmp/b1 2>&1 | tail -2
cp /tmp/b1/report.md $OUT/smollm2_report.md; cp /tmp/b1/results.json $OUT/smollm2_results.json
Q="--pair $M/qwen2.5-coder-1.5b-random:model:$M/qwen2.5-coder-0.5b-random --workload .gpu/humaneval_dev.jsonl --limit 3 --k auto,2,4 --max-new-tokens 48 --repeats 2"
timeout 110 python3 -m specdec.cli bench --device cuda --dtype float32 --draft-dtype bfloat16 --peers hf $Q --out /tmp/b2 2>&1 | tail -2
cp /tmp/b2/report.md $OUT/qwen_fp32_report.md; cp /tmp/b2/results.json $OUT/qwen_fp32_results.json
timeout 100 python3 -m specdec.cli bench --device cuda --dtype bfloat16 --peers hf,hf-assisted $Q --out /tmp/b3 2>&1 | tail -2
cp /tmp/b3/report.md $OUT/qwen_bf16_report.md; cp /tmp/b3/results.json $OUT/qwen_bf16_results.json
