# One device-tool call: optional GPU tests, then `bench throughput` for each WORKLOAD:MODEL[:BACKEND] argument.
# Usage (device tool, carry .whl): TESTS=1 bash scripts/gpu_bench.sh nano256:qwen3-0.6b docs1000-json:qwen3-0.6b:xgrammar
# BACKEND sets engine.grammar_backend; PROFILE=1 profiles 5 steps of each run (BATCHINFER_PROFILE_START, default 60);
# OVERRIDES='{"grammar_threads": 8, "torch_threads": 2}' sets more EngineConfig fields. JSON reports go to $OUT/<workload>-<model>[-<backend>].json.
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
  timeout ${LIMIT:-200} python3 - "$wl" "$model" "$backend" "$OUT/$name.json" <<'PY' 2>&1 | grep -v -i -E "warn|regex pattern" | sed -n "/^workload \|Error\|error/,\$p"
import sys
from pathlib import Path
from batchinfer.bench.throughput import format_report, run_throughput, write_report
import json, os
wl, model, backend, out = sys.argv[1:5]
overrides = json.loads(os.environ.get("OVERRIDES") or "{}")  # more EngineConfig fields, e.g. {"grammar_threads": 8}
if backend:
    overrides["grammar_backend"] = backend
r = run_throughput(model, wl, overrides or None)
write_report(r, Path(out))
print(format_report(r))
PY
done
