# One device-tool call: optional GPU tests, then `batchinfer bench throughput` for each WORKLOAD:MODEL[:BACKEND] argument.
# Usage (device tool, carry .whl): TESTS=1 bash scripts/gpu_bench.sh nano256:qwen3-0.6b docs1000-json:qwen3-0.6b:xgrammar
# BACKEND is --grammar-backend; ARGS="--grammar-threads 8 --torch-threads 2" adds options to every run;
# PROFILE=1 profiles 5 steps of each run (BATCHINFER_PROFILE_START, default 60). JSON reports go to
# $OUT/<workload>-<model>[-<backend>].json.
source scripts/device_setup.sh
if [ -n "$TESTS" ]; then
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py \
    tests/test_kernels_sampling.py tests/test_sampler.py tests/test_models.py > $OUT/gpu-tests.log 2>&1
  grep -E "passed|failed|Error" $OUT/gpu-tests.log | tail -8
fi
for spec in "$@"; do
  IFS=: read -r wl model backend <<< "$spec"
  name="$wl-$model${backend:+-$backend}"
  echo "=== $name"
  [ -n "$PROFILE" ] && export BATCHINFER_PROFILE_DIR=$OUT/prof-$name
  # shellcheck disable=SC2086  # ARGS is a list of options
  timeout ${LIMIT:-200} python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" throughput \
    --workload "$wl" --model "$model" ${backend:+--grammar-backend "$backend"} $ARGS --out "$OUT/$name.json" 2>&1 \
    | grep -v -i -E "warn|regex pattern" | sed -n "/^workload \|Error\|error/,\$p"
done
