# One device-tool call: optional GPU tests, then `batchinfer bench throughput` for each WORKLOAD:MODEL[:BACKEND] argument.
# Usage (device tool, carry .whl): TESTS=1 bash scripts/gpu_bench.sh nano256:qwen3-0.6b docs1000-json:qwen3-0.6b:xgrammar
# BACKEND is --grammar-backend; ARGS="--grammar-threads 8 --torch-threads 2" adds options to every run;
# PROFILE=1 profiles 5 steps of each run (BATCHINFER_PROFILE_START, default 60). JSON reports go to
# $OUT/<workload>-<model>[-<backend>][-base].json.
# TESTS=1 runs the GPU tests of the engine, kernels and sampler; TESTS=all the whole `pytest -m gpu` suite (what a
# GPU-path change needs before it lands). BASE=1 (carry .base too) runs each spec again on the tree in .base/
# (`rm -rf .base && mkdir .base && git archive REV | tar -x -C .base`, git-ignored) right after this tree's
# run, so the two compare inside one call. E.g. (the sixteenth session's RowMasks A/B, BENCHMARKS.md):
#   TESTS=all BASE=1 ARGS=--plain-twin bash scripts/gpu_bench.sh docs1000-json:qwen2.5-1.5b
source scripts/device_setup.sh
root=$PWD
if [ "$TESTS" = all ]; then
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > $OUT/gpu-tests.log 2>&1
  grep -E "passed|failed|Error" $OUT/gpu-tests.log | tail -8
elif [ -n "$TESTS" ]; then
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py \
    tests/test_kernels_sampling.py tests/test_sampler.py tests/test_models.py > $OUT/gpu-tests.log 2>&1
  grep -E "passed|failed|Error" $OUT/gpu-tests.log | tail -8
fi
for spec in "$@"; do
  IFS=: read -r wl model backend <<< "$spec"
  for tree in new ${BASE:+base}; do
    dir=$root; suffix=""
    if [ "$tree" = base ]; then dir=$root/.base; suffix="-base"; fi
    [ -d "$dir/batchinfer" ] || { echo "no $dir/batchinfer"; continue; }
    name="$wl-$model${backend:+-$backend}$suffix"
    echo "=== $name"
    [ -n "$PROFILE" ] && export BATCHINFER_PROFILE_DIR=$OUT/prof-$name
    # bench as a command (device_setup.sh), PYTHONPATH picking the tree
    # shellcheck disable=SC2086  # ARGS is a list of options
    PYTHONPATH=/tmp/site:$dir timeout ${LIMIT:-200} bench throughput \
      --workload "$wl" --model "$model" ${backend:+--grammar-backend "$backend"} $ARGS --out "$OUT/$name.json" 2>&1 \
      | grep -v -i -E "warn|regex pattern" | sed -n "/^workload \|Error\|error/,\$p"
  done
done
