#!/usr/bin/env bash
# The supported vLLM releases other than the installed 0.33.0 (0.31.0, 0.32.0, 0.34.0) for the interop tests,
# extracted from their PyPI wheels. The interop tests' peer process imports them with PYTHONPATH=<extracted
# wheel> inside .venv-vllm (built for 0.33.0 by venv.sh; these releases pin the same torch and import with the
# same packages; 0.34's x86 CPU platform also asks for triton-cpu before it builds a config, which
# hack/vllm/peer.py answers for the config build only).
#
#   bash hack/vllm/wheels.sh          # idempotent: <cache>/<v>/vllm-<v>-*.whl and <cache>/x/<v>/
#
# VLLM_WHEEL_CACHE is the cache (default: ~/.cache/disagg/vllm-wheels, as venv.sh). A fresh machine downloads about
# 900 MB (~12 s at 80 MB/s) and extracts it (~15 s); afterwards it returns at once.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEEL_CACHE=${VLLM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/vllm-wheels}
PYTHON=${PYTHON:-python3}
RELEASES=(0.31.0 0.32.0 0.34.0)
# shellcheck source=hack/vllm/lib.sh
source "$ROOT/hack/vllm/lib.sh"
# shellcheck source=hack/vllm/extract.sh
source "$ROOT/hack/vllm/extract.sh"

for version in "${RELEASES[@]}"; do
    extract_release "$WHEEL_CACHE" "$version" "$PYTHON"
done
