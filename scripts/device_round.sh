# One device call of this round (issue 15, 21 and the KV sizing fix): the GPU suite, then benches in order of
# priority, each only while the call's time allows (BUDGET seconds from the start, default 540).
source scripts/device_setup.sh >/dev/null
t0=$SECONDS; left() { echo $(( ${BUDGET:-540} - (SECONDS - t0) )); }
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > $OUT/gpu-tests.log 2>&1
grep -E "passed|failed|Error" $OUT/gpu-tests.log | tail -6
run() {  # name need_s bench-args...
  local name=$1 need=$2; shift 2
  [ "$(left)" -ge "$need" ] || { echo "=== $name skipped ($(left) s left)"; return; }
  echo "=== $name"
  timeout "$(left)" bench throughput "$@" --out "$OUT/$name.json" 2>&1 | grep -v -i -E "warn|regex pattern" \
    | grep -E "^elapsed|decode-only|^speculative|oracle drafts|decode 193|prefill/mixed|decode 17|plain twin|constrained again"
}
run nano256-oracle10-k6 45 --workload nano256 --model qwen3-0.6b --speculative oracle --oracle-corrupt 0.10 --spec-tokens 6
run nano256-oracle10 45 --workload nano256 --model qwen3-0.6b --speculative oracle --oracle-corrupt 0.10
run nano256-plain 30 --workload nano256 --model qwen3-0.6b
run docs1000-oracle10 100 --workload docs1000 --model qwen3-0.6b --speculative oracle --oracle-corrupt 0.10
run docs1000-plain 50 --workload docs1000 --model qwen3-0.6b
run docs1000-oracle10-k6 100 --workload docs1000 --model qwen3-0.6b --speculative oracle --oracle-corrupt 0.10 --spec-tokens 6
run docs1000-json-twin-0.6b 80 --workload docs1000-json --model qwen3-0.6b --plain-twin
