# Sourced at the start of a device-tool run on the H200 (no internet there): install the carried
# wheels (.whl/, made by scripts/fetch_device_wheels.sh) and put the repo on the path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
bench() { python3 -c "import sys; from batchinfer.bench.cli import bench_app; sys.argv[0]='batchinfer bench'; bench_app()" "$@"; }
