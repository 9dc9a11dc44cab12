#!/usr/bin/env bash
# A test-peer venv with the real vLLM 0.33.0 (its pure-Python modules, on CPU torch), kept apart from the
# project's .venv because vLLM pins other versions than the project.
#
#   bash hack/vllm/venv.sh            # idempotent: creates .venv-vllm/ in the repository root
#   .venv-vllm/bin/python -c 'import vllm.envs'
#
# What it does, in order: python3 -m venv; pip install torch==2.13.0 (the CPU build; never unpinned);
# pip install --no-deps vllm==0.33.0 (from a wheel downloaded once into the wheel cache); pip install --no-deps
# -r hack/vllm/requirements.txt (the pure-Python packages with which vLLM's modules import, plus msgspec, pyzmq,
# pytest). vLLM's compiled kernels (CUDA) are installed but never loaded: no engine runs here.
#
# Settings (environment):
#   VLLM_VENV          where the venv goes (default: <repo>/.venv-vllm)
#   VLLM_VERSION       default 0.33.0 (other releases work the same way, but the requirements are pinned for 0.33)
#   VLLM_WHEEL_CACHE   where the ~340 MB wheels are kept, one folder per version (default: ~/.cache/disagg/vllm-wheels,
#                      beside the control plane's cache, so every checkout on a machine shares it)
#   PYTHON             interpreter for the venv (default python3)
#   VLLM_VENV_VERBOSE  1: show pip's output
# The stamp file (<venv>/.installed) holds a digest of this script, lib.sh, the requirements and the version;
# the venv is rebuilt in place when any of them changes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
LIB=$ROOT/hack/vllm/lib.sh
REQS=$ROOT/hack/vllm/requirements.txt
WHEEL_CACHE=${VLLM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/vllm-wheels}
PYTHON=${PYTHON:-python3}
# shellcheck source=hack/vllm/lib.sh
source "$LIB"

digest=$( { cat "${BASH_SOURCE[0]}" "$LIB" "$REQS"; echo "$VLLM_VERSION"; } | sha256sum | cut -d' ' -f1)
venv_current "$VENV" "$digest" && exit 0

# 1. The venv and the CPU torch, pinned.
venv_start "$VENV" "$PYTHON"

# 2. vLLM itself, without its dependency tree (CUDA torch, flashinfer, ...). The wheel is downloaded once.
vllm_wheel "$WHEEL_CACHE" "$VLLM_VERSION" run "${PIP[@]}"
run "${PIP[@]}" install --quiet --no-deps "$WHEEL"

# 3. The pure-Python peers vLLM's modules import, each pinned, without dependencies.
run "${PIP[@]}" install --quiet --no-deps -r "$REQS"

# 4. Smoke test: the modules the peer tests use import on CPU.
run env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import vllm, vllm.envs, vllm.engine.arg_utils, vllm.entrypoints.cli.serve
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata, base_scheduler, base_worker
assert vllm.__version__ == "'"$VLLM_VERSION"'", vllm.__version__
'
venv_done "$VENV" "$digest"
