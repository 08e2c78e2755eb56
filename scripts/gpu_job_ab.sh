# One device-tool call for the whole job: the GPU suite (TESTS=1), then `batchinfer bench job` for each
# MODEL:DOCS argument on this tree and, where .base/ holds another tree (`git archive REV | tar -x -C .base`,
# git-ignored), on that one right after it, so the two compare inside one call.
# Usage (device tool, carry .whl and .base): TESTS=1 bash scripts/gpu_job_ab.sh qwen2.5-7b:1000 qwen3-0.6b:2000
# ARGS adds options to every bench job; MODEL:DOCS:new runs that one on this tree only. Reports:
# $OUT/job-<model>-<docs>-{new,base}.{json,txt}.
source scripts/device_setup.sh
root=$PWD
if [ -n "$TESTS" ]; then
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/gpu-tests.log" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu-tests.log" | tail -8
fi
for spec in "$@"; do
  IFS=: read -r model docs only <<< "$spec"
  for tree in ${only:-new base}; do
    dir=$root; [ "$tree" = base ] && dir=$root/.base
    [ -d "$dir/batchinfer" ] || continue
    name="job-$model-$docs-$tree"
    echo "=== $name"
    # shellcheck disable=SC2086  # ARGS is a list of options
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout ${LIMIT:-240} python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" \
      job --model "$model" --docs "$docs" --json "$OUT/$name.json" $ARGS > "$OUT/$name.txt" 2>&1)
    sed -n '/^bench job:/,$p' "$OUT/$name.txt" | grep -v -i -E "warn|regex pattern"
    grep -E "Error|error:" "$OUT/$name.txt" | tail -3
  done
done
