# Sourced by the .devscripts/run*.sh device scripts: installs the carried wheels (.whl: tokamax and
# its dependencies; .whl/extra: pytest-xdist), sets PYTHONPATH and logs the GPU and the start time.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site:$PWD/.whl/extra
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
date -u | tee -a $OUT/gpu.txt
