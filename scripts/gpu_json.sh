# One device-tool call: docs1000 against docs1000-json on qwen3-0.6b (the structured-output target).
source scripts/device_setup.sh
b() { timeout "$1" python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" throughput "${@:2}" 2>&1 | grep -v -i -E "warn|regex pattern" | tail -7; }
b 100 --workload docs1000-json --model qwen3-0.6b --out $OUT/docsjson-q.json
b 60 --workload docs1000 --model qwen3-0.6b --out $OUT/docs-q.json
