#!/usr/bin/env bash
# kvtier's GPU kit: checks the CUDA copy path with real CUDA streams (tests/gpu), measures it
# (tests/gpu/bench_copies.py), and prints ONE JSON verdict (tests/gpu/summarize.py). Two modes:
#
#   scripts/gpu-check.sh --fetch-wheels
#       HERE (a machine with PyPI): downloads CPython 3.12 manylinux x86_64 wheels of kvtier's runtime
#       dependencies, pytest and pip itself into .gpu-wheels/ (ignored by git, ~25 MB), to carry to the
#       GPU machine with the working tree (the device tool: carry [".gpu-wheels"]).
#
#   scripts/gpu-check.sh
#       THERE (a GPU machine with PyTorch + CUDA and Python 3.12, no vLLM, no network): installs those
#       wheels with --no-index into .gpu-site/ using pip run from its own wheel (no venv, no ensurepip;
#       the system's torch and numpy are used), runs tests/gpu, then the benchmark (LBNHC,
#       FlashAttention's default, and BLNHC, block-outermost), and prints one JSON: pass/fail per
#       check, copy bandwidth as a fraction of one cudaMemcpyAsync of the same bytes at 8, 16 and
#       64 KiB pages for stores and loads, host time to issue a 512-block job, a GEMM's slowdown
#       beside stores and loads, the card and driver. Exits 1 when a check fails or a goal is missed
#       (>= 0.95 of one cudaMemcpyAsync at every page size both ways in both layouts, < 0.2 ms to
#       issue, GEMM slowdown <= 1.05x beside a store and no more than a plain copy's beside a load;
#       a fraction above 1.05 is a measurement error), 0 otherwise. Reported, not judged: at 16 KiB pages
#       the GEMM's slowdown and the bandwidth of staged jobs whose kernels run on fewer thread blocks
#       (kernel_blocks_sweep, with the cap that slowed the GEMM least: least_load_slowdown), and the
#       start call issued after host work instead of a device wait (call_after_host_work). About 1.5-2
#       minutes on an H200 (each step is bounded; the whole run stays under 10). Details in
#       gpu-check-results/ (and $OUT when the device tool sets it). On a machine without a CUDA device it prints that it skipped and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.gpu-wheels
SITE=.gpu-site
RESULTS=gpu-check-results
PY=${PYTHON:-python3}
# kvtier's runtime dependencies (pyproject.toml) but torch, which the GPU machine brings; and pytest.
DEPS=("blake3>=1.0" "xxhash>=3.4" "click>=8.1" "rich>=13" "redis>=5.2" "hiredis>=3" "pytest>=8"
      "pytest-timeout>=2.3")

case "${1:-}" in
  ""|--fetch-wheels) ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "kvtier gpu-check: unknown argument '$1' (usage: scripts/gpu-check.sh [--fetch-wheels | --help])" >&2
     exit 2 ;;
esac
if [[ $# -gt 1 ]]; then
  echo "kvtier gpu-check: one argument at most (usage: scripts/gpu-check.sh [--fetch-wheels | --help])" >&2
  exit 2
fi

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  rm -rf "$WHEELS"
  "$PY" -m pip download --disable-pip-version-check -q --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 -d "$WHEELS" pip numpy "${DEPS[@]}"
  echo "kvtier gpu-check: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS/"
  exit 0
fi

why_not=$("$PY" -c 'import torch; print("" if torch.cuda.is_available() else
  f"torch {torch.__version__} sees no CUDA device")' 2>/dev/null || echo "$PY cannot import torch")
if [[ -n "$why_not" ]]; then
  echo "{\"skipped\": \"no GPU to check here ($why_not)\", \"ok\": true}"
  echo "kvtier gpu-check: skipped: no GPU to check here ($why_not); exit 0" >&2
  exit 0
fi
if [[ ! -d "$WHEELS" ]]; then
  echo "kvtier gpu-check: $WHEELS/ is missing: run 'scripts/gpu-check.sh --fetch-wheels' where PyPI is reachable" >&2
  exit 2
fi
"$PY" -c 'import numpy' 2>/dev/null || DEPS+=(numpy)  # never shadow the numpy torch was installed with
PIP=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | head -1)
if [[ -n "$PIP" ]]; then
  "$PY" "$PIP/pip" install --disable-pip-version-check -q --no-index --find-links "$WHEELS" --target "$SITE" \
      --upgrade "${DEPS[@]}" >&2
else  # wheels fetched before pip was among them: the system's pip
  "$PY" -m pip install --disable-pip-version-check -q --no-index --find-links "$WHEELS" --target "$SITE" \
      --upgrade "${DEPS[@]}" >&2
fi
export PYTHONPATH="$PWD/src:$PWD/$SITE"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
"$PY" -c 'import torch; print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)' \
  > "$RESULTS/device.txt"
timeout 240 "$PY" -m pytest -p no:cacheprovider -q -rs --timeout 60 --junitxml "$RESULTS/pytest.xml" tests/gpu \
  > "$RESULTS/pytest.txt" 2>&1 || true
for layout in LBNHC BLNHC; do
  timeout 150 "$PY" tests/gpu/bench_copies.py --layout "$layout" > "$RESULTS/bench-$layout.json" \
    2> "$RESULTS/bench-$layout.err" || true
done
status=0
"$PY" tests/gpu/summarize.py "$RESULTS" | tee "$RESULTS/summary.json" || status=1
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then cp -r "$RESULTS" "$OUT/"; fi
exit $status
