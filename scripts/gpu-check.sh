#!/usr/bin/env bash
# kvtier's GPU kit: checks the CUDA copy path with real CUDA streams (tests/gpu) and measures it
# (tests/gpu/bench_copies.py, JSON). Two modes:
#
#   scripts/gpu-check.sh --fetch-wheels
#       HERE (a machine with PyPI): downloads CPython 3.12 manylinux x86_64 wheels of kvtier's runtime
#       dependencies and pytest into .gpu-wheels/ (ignored by git, ~20 MB), to carry to the GPU machine
#       with the working tree (the device tool: carry [".gpu-wheels"]).
#
#   scripts/gpu-check.sh
#       THERE (a GPU machine with PyTorch + CUDA and Python 3.12, no vLLM, no network): installs those
#       wheels with --no-index into .gpu-venv (which sees the system's torch), runs tests/gpu, then the
#       benchmark; results in gpu-check-results/ (and in $OUT when the device tool sets it).
#       On a machine without a CUDA device it prints that it skipped and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.gpu-wheels
VENV=.gpu-venv
RESULTS=gpu-check-results
PY=${PYTHON:-python3}
# kvtier's runtime dependencies (pyproject.toml) but torch, which the GPU machine brings; and pytest.
DEPS=(numpy "blake3>=1.0" "xxhash>=3.4" "click>=8.1" "rich>=13" "redis>=5.2" "hiredis>=3" "pytest>=8"
      "pytest-timeout>=2.3")

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  rm -rf "$WHEELS"
  "$PY" -m pip download --disable-pip-version-check -q --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 -d "$WHEELS" "${DEPS[@]}"
  echo "kvtier gpu-check: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS/"
  exit 0
fi

why_not=$("$PY" -c 'import torch; print("" if torch.cuda.is_available() else
  f"torch {torch.__version__} sees no CUDA device")' 2>/dev/null || echo "$PY cannot import torch")
if [[ -n "$why_not" ]]; then
  echo "kvtier gpu-check: skipped: no GPU to check here ($why_not); exit 0"
  exit 0
fi
if [[ ! -d "$WHEELS" ]]; then
  echo "kvtier gpu-check: $WHEELS/ is missing: run 'scripts/gpu-check.sh --fetch-wheels' where PyPI is reachable" >&2
  exit 2
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-index --find-links "$WHEELS" "${DEPS[@]}"
mkdir -p "$RESULTS"
"$VENV/bin/python" -c 'import torch; print("kvtier gpu-check:", torch.cuda.get_device_name(), "torch", torch.__version__, "CUDA", torch.version.cuda)' \
  | tee "$RESULTS/device.txt"
status=0
PYTHONPATH=src "$VENV/bin/python" -m pytest -p no:cacheprovider -q -rs tests/gpu 2>&1 | tee "$RESULTS/pytest.txt" \
  || status=1
for layout in LBNHC LBHNC; do
  PYTHONPATH=src "$VENV/bin/python" tests/gpu/bench_copies.py --layout "$layout" | tee "$RESULTS/bench-$layout.json" \
    || status=1
done
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp -r "$RESULTS" "$OUT/"; fi
exit $status
