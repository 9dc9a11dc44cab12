#!/usr/bin/env bash
# The next vLLM release in a day: `make vllm-release VERSION=0.35.0` (or `bash hack/vllm/release.sh 0.35.0`).
#
# 1. the test peer venv (.venv-vllm, hack/vllm/venv.sh) and the release's wheel, downloaded once into the wheel
#    cache and extracted to <cache>/x/<VERSION> (as hack/vllm/wheels.sh does for the supported ones);
# 2. its golden vectors, made by its own classes: tests/golden/vllm/<VERSION>/ (hack/vllm/golden.py);
# 3. hack/vllm/release.py: its connector facts from its own code, what changed against the newest supported
#    release, and what the project does not yet handle. Exits non-zero until nothing is missing.
set -euo pipefail

VERSION=${1:?usage: release.sh VERSION (a vLLM release such as 0.35.0)}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEEL_CACHE=${VLLM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/vllm-wheels}
PYTHON=${PYTHON:-python3}
# shellcheck source=hack/vllm/lib.sh
source "$ROOT/hack/vllm/lib.sh"
# shellcheck source=hack/vllm/extract.sh
source "$ROOT/hack/vllm/extract.sh"

bash "$ROOT/hack/vllm/venv.sh"
installed=$("$ROOT/.venv-vllm/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')
peer_path=()
if [[ $VERSION != "$installed" ]]; then
    extract_release "$WHEEL_CACHE" "$VERSION" "$PYTHON"
    peer_path=(env "PYTHONPATH=$WHEEL_CACHE/x/$VERSION")
fi
cd "$ROOT"
echo "release.sh: golden vectors of vLLM $VERSION (its own classes) -> tests/golden/vllm/$VERSION" >&2
"${peer_path[@]}" .venv-vllm/bin/python hack/vllm/golden.py --expect-version "$VERSION" 2>/dev/null | tail -n 3 >&2
exec .venv/bin/python hack/vllm/release.py "$VERSION"
