# The GPU check: run from the repo root on the device machine. Each step is bounded; outputs to $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi -L; python3 -c "import torch, transformers, tokenizers; print(torch.__version__, transformers.__version__, tokenizers.__version__, torch.cuda.get_device_name(0))"; } 2>&1 | tee $OUT/env.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_lean.py tests/test_eagle.py 2>&1 | tail -25 | tee $OUT/pytest.txt
timeout 70 python3 .gpu/make_random.py /tmp/models 2>&1 | tail -5
B="python3 -m specdec.cli bench --device cuda --peers hf,hf-lookup"
timeout 150 $B --pair /tmp/models/smollm2-135m-random --pair /tmp/models/smollm2-135m-random:eagle-tree:specdec/data/heads/smollm2-135m.safetensors --workload .gpu/spec_bench_dev.jsonl --quick --out /tmp/b1 2>&1 | tail -4
cp /tmp/b1/results.json $OUT/smollm2_results.json; cp /tmp/b1/report.md $OUT/smollm2_report.md
timeout 170 python3 -m specdec.cli bench --device cuda --dtype bfloat16 --peers hf,hf-assisted --pair /tmp/models/qwen2.5-coder-1.5b-random:model:/tmp/models/qwen2.5-coder-0.5b-random --workload .gpu/humaneval_dev.jsonl --limit 4 --k auto,2,4 --max-new-tokens 64 --out /tmp/b2 2>&1 | tail -4
cp /tmp/b2/results.json $OUT/qwen_results.json; cp /tmp/b2/report.md $OUT/qwen_report.md
