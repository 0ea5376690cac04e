# Sourced by the device suites (run from the repository root on a GPU machine). Sets the
# environment, installs tokamax's wheels if .whl/ carries them (optional: the kernel benchmarks
# record "tokamax import failed" without them), writes the GPU, the date and jax's version to
# $OUT/gpu.txt, and defines `step NAME TIMEOUT_S CMD...`: CMD under a timeout, its output (without
# the warning noise) in $OUT/NAME.log, the last $TAIL lines on the console.
# With BRANCHES (comma list; `base` is HEAD): the suite runs once per version that
# benchmarks/prepare_branches.sh wrote to .variants/<ref>/ (call with carry=[".variants"]), each
# with OUT=$OUT/<ref>, the version's files in place of HEAD's and HEAD's back after it (trap).
set -o pipefail
if [ -n "${BRANCHES:-}" ] && [ -z "${_LCP_BRANCH:-}" ]; then
  _bk=$(mktemp -d)
  _restore() {   # HEAD's files back; files HEAD does not have removed
    if [ -d "$_bk/f" ]; then cp -r "$_bk/f/." .; rm -rf "$_bk/f"; fi
    if [ -f "$_bk/new" ]; then xargs -r rm -f < "$_bk/new"; rm -f "$_bk/new"; fi
  }
  trap _restore EXIT
  trap "exit 143" TERM INT
  for _name in ${BRANCHES//,/ }; do
    _restore
    if [ "$_name" != base ]; then
      [ -d ".variants/$_name" ] || { echo "== $_name: not prepared (.variants/$_name)"; continue; }
      for _f in $(cd ".variants/$_name" && find . -type f); do
        if [ -f "$_f" ]; then mkdir -p "$_bk/f/$(dirname "$_f")"; cp "$_f" "$_bk/f/$_f"
        else echo "$_f" >> "$_bk/new"; mkdir -p "$(dirname "$_f")"; fi
        cp ".variants/$_name/$_f" "$_f"
      done
    fi
    echo "== version $_name ($SECONDS s)"
    _LCP_BRANCH=$_name OUT="${OUT:-benchmarks/results/device}/$_name" bash "$0" "$@"
  done
  exit 0
fi
PY=${PYTHON:-python3}  # the device image's python3 holds jax
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Never NVLink multicast (DESIGN.md); the machines set these too, keep them for child processes.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-benchmarks/results/device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# The compiled planner (liquidcp_jax.megadcp._cw_native) for this machine's python; without a C
# compiler the planner falls back to its pure-Python reference (slower host planning, same plans).
"$PY" setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || { echo "build_ext failed:"; tail -5 /tmp/build_ext.log; }
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
  date -u
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
  "$PY" -c "from liquidcp_jax.megadcp import critical_wave as c; print('native planner', c.native_available())" 2>&1 | tail -1; } | tee "$OUT/gpu.txt"
NOISE='Warning: \|warnings.warn\|warner(\|absl\|bfc_allocator\|hlo_remat\|fragmentation\|allocation summary'

step() {
  local name=$1 limit=$2; shift 2
  echo "== $name ($limit s): $*"
  timeout "$limit" "$@" 2>&1 | grep -v "$NOISE" | tee "$OUT/$name.log" | tail -n "${TAIL:-40}"
}
