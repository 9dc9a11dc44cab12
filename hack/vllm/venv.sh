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
# The stamp file (<venv>/.installed) holds a digest of this script, the requirements and the version; the venv
# is rebuilt in place when any of them changes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${VLLM_VENV:-$ROOT/.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
TORCH_PIN=torch==2.13.0
REQS=$ROOT/hack/vllm/requirements.txt
WHEEL_CACHE=${VLLM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/vllm-wheels}
PYTHON=${PYTHON:-python3}
STAMP=$VENV/.installed
# The repository has an operator/ folder; with the working directory on sys.path (python -m, python -c) it would
# shadow the standard library's operator module.
export PYTHONSAFEPATH=1

digest=$( { cat "${BASH_SOURCE[0]}" "$REQS"; echo "$VLLM_VERSION"; } | sha256sum | cut -d' ' -f1)
if [[ -f $STAMP && $(cat "$STAMP") == "$digest" && -x $VENV/bin/python ]]; then
    exit 0
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
run() {
    if [[ ${VLLM_VENV_VERBOSE:-0} == 1 ]]; then
        "$@"
    elif ! "$@" >>"$log" 2>&1; then
        echo "venv.sh: failed: $*" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
}

rm -f "$STAMP"
[[ -x $VENV/bin/python ]] || run "$PYTHON" -m venv "$VENV"
# A venv in the repository root that git must not see (the repository's .gitignore is not ours to change).
echo '*' >"$VENV/.gitignore"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 1. The CPU torch, pinned (the machine's pip config finds the local CPU wheel).
run "${PIP[@]}" install --quiet "$TORCH_PIN"

# 2. vLLM itself, without its dependency tree (CUDA torch, flashinfer, ...). The wheel is downloaded once.
wheel_dir=$WHEEL_CACHE/$VLLM_VERSION
shopt -s nullglob
wheels=("$wheel_dir"/vllm-"$VLLM_VERSION"-*.whl)
if (( ${#wheels[@]} == 0 )); then
    mkdir -p "$wheel_dir"
    run "${PIP[@]}" download --quiet --no-deps "vllm==$VLLM_VERSION" -d "$wheel_dir"
    wheels=("$wheel_dir"/vllm-"$VLLM_VERSION"-*.whl)
fi
shopt -u nullglob
run "${PIP[@]}" install --quiet --no-deps "${wheels[0]}"

# 3. The pure-Python peers vLLM's modules import, each pinned, without dependencies.
run "${PIP[@]}" install --quiet --no-deps -r "$REQS"

# 4. Smoke test: the modules the peer tests use import on CPU.
run env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import vllm, vllm.envs, vllm.engine.arg_utils, vllm.entrypoints.cli.serve
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata, base_scheduler, base_worker
assert vllm.__version__ == "'"$VLLM_VERSION"'", vllm.__version__
'
echo "$digest" >"$STAMP"
