# One device-tool call for the engine's GPU work: GPU tests, a profiled nano256 run, the benches.
# Usage (device tool, carry .whl): bash scripts/gpu_engine_perf.sh
source scripts/device_setup.sh
b() { timeout "$1" python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" throughput "${@:2}" 2>&1 | grep -v -i warn | tail -"${TAILN:-7}"; }
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_models.py tests/test_sampler.py tests/test_kernels_gpu.py tests/test_kernels_sampling.py > $OUT/gpu-tests.log 2>&1; tail -4 $OUT/gpu-tests.log
BATCHINFER_PROFILE_DIR=$OUT/prof b 150 --workload nano256 --model qwen3-0.6b --out $OUT/nano-q.json | tail -5
b 150 --workload nano256 --model llama-3.1-8b --out $OUT/nano-l.json | tail -4
b 150 --workload docs1000 --model qwen3-0.6b --out $OUT/docs-q.json | tail -4
b 150 --workload docs1000 --model qwen3-0.6b --max-num-batched-tokens 16384 --out $OUT/docs-q16k.json | tail -4
grep -E "passed|failed|Error|assert" $OUT/gpu-tests.log | head -20
rm -f $OUT/prof/top-cpu_time_total.txt $OUT/prof/trace.json
