#!/usr/bin/env bash
# Fetch vLLM 0.33.0's released Python files for the tests (tests/test_native_vllm033.py runs
# kvtier's native tiers against 0.33's API and its real tiering manager, in a subprocess whose
# `vllm` is these files).
#   scripts/fetch_vllm033.sh [VENV]     (default .venv; scripts/install.sh --test runs it)
# Downloads vLLM 0.33.0's wheel from the package index with pip (pinned by its sha256; ~340 MB,
# deleted afterwards) and keeps only its .py files and METADATA (~50 MB) in
# VENV/kvtier-vllm-0.33.0/, where the tests look (sys.prefix of the Python running them).
# Cached: a later run finds the folder complete and downloads nothing. Any failure exits non-zero
# with the reason: CI must not run without these files (the tests fail, they do not skip).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.33.0
WHEEL=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
venv=${1:-.venv}
dest="$venv/kvtier-vllm-$VERSION"
[[ -f "$dest/.complete" ]] && exit 0

echo "kvtier: fetching vLLM $VERSION's wheel for the 0.33 tests (~340 MB download, ~50 MB kept)..."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "vllm==$VERSION --hash=sha256:$SHA256" >"$tmp/requirements.txt"
# The wheel is pure data here (never installed): any host may download the x86_64 one.
if ! "$venv/bin/python" -m pip --disable-pip-version-check -q download --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp \
    -d "$tmp" -r "$tmp/requirements.txt"; then
  echo "kvtier: could not fetch $WHEEL with sha256 $SHA256 from the package index (see pip above);" \
       "tests/test_native_vllm033.py needs it. Fix the index access (or the pinned hash) and run scripts/install.sh --test again." >&2
  exit 1
fi
rm -rf "$dest" "$dest.partial"
"$venv/bin/python" - "$tmp/$WHEEL" "$dest.partial" <<'PY'
import sys
import zipfile

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    keep = [n for n in z.namelist()
            if (n.startswith("vllm/") and n.endswith(".py")) or n in (
                "vllm-0.33.0.dist-info/METADATA", "vllm-0.33.0.dist-info/licenses/LICENSE")]
    z.extractall(out, keep)
print(f"kvtier: kept {len(keep)} files of {wheel.rsplit('/', 1)[-1]}")
PY
touch "$dest.partial/.complete"
mv "$dest.partial" "$dest"
