# Sourced at the start of a device-tool run on the H200 (no internet there): install the carried
# wheels (.whl/, made by scripts/fetch_device_wheels.sh) and put the repo on the path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The image's Python packages ship without bytecode in a read-only tree, so every process compiled
# ~2,000 sources again (3.8 s of a job's start-up, measured); a pip install writes bytecode once. Give
# repeated processes that bytecode cache, in a writable place.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# `bench` as a command, not a shell function, so that `timeout N bench ...` works. python3 -P: the current
# folder is not put first on sys.path, so PYTHONPATH decides which tree runs (an A/B against an older tree:
# `PYTHONPATH=/tmp/site:$PWD/.base bench ...`, with that tree (`git archive REV | tar -x -C .base`) in the ignored .base/).
mkdir -p /tmp/bin
cat > /tmp/bin/bench <<'EOF'
#!/bin/sh
exec python3 -P -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0] = 'batchinfer bench'; bench_app()" "$@"
EOF
chmod +x /tmp/bin/bench
export PATH=/tmp/bin:$PATH
