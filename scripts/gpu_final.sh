# One device-tool call: GPU tests, then every benchmark the issues name (overlap on, CUDA graphs on).
# Usage (device tool, carry .whl): bash scripts/gpu_final.sh
source scripts/device_setup.sh
b() { timeout "$1" python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" throughput "${@:2}" 2>&1 | grep -v -i -E "warn|regex pattern" | tail -7; }
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_models.py tests/test_sampler.py tests/test_kernels_gpu.py tests/test_kernels_sampling.py > $OUT/gpu-tests.log 2>&1; grep -E "passed|failed|Error" $OUT/gpu-tests.log | tail -8
b 70 --workload nano256 --model qwen3-0.6b --out $OUT/nano-q.json
b 90 --workload nano256 --model llama-3.1-8b --out $OUT/nano-l.json
b 70 --workload docs1000 --model qwen3-0.6b --out $OUT/docs-q.json
b 80 --workload docs1000-json --model qwen3-0.6b --out $OUT/docsjson-q.json
b 170 --workload docs1000 --model llama-3.1-8b --out $OUT/docs-l.json
