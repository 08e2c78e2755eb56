# One device-tool call: GPU correctness of the decode path, the decode kernel/GEMM micro-benchmarks,
# then nano256 on both shapes with the per-step breakdown (and a profile window of llama-3.1-8b).
# Usage (device tool, carry .whl): bash scripts/gpu_decode_tuning.sh
source scripts/device_setup.sh
b() { timeout "$1" python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" throughput "${@:2}" 2>&1 | grep -v -i -E "warn|regex pattern" | tail -14; }
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py tests/test_kernels_sampling.py tests/test_sampler.py > $OUT/gpu-tests.log 2>&1; grep -E "passed|failed|Error" $OUT/gpu-tests.log | tail -8
timeout 200 python3 scripts/bench_decode_kernels.py ${QUICK:+--quick} 2>&1 | tee $OUT/kernels.txt | grep -v -i warn
b 80 --workload nano256 --model qwen3-0.6b --out $OUT/nano-q.json
BATCHINFER_PROFILE_DIR=$OUT/prof-l BATCHINFER_PROFILE_START=150 b 130 --workload nano256 --model llama-3.1-8b --out $OUT/nano-l.json
