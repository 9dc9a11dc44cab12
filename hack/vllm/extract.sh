# shellcheck shell=bash
# extract_release CACHE VERSION PYTHON: vLLM VERSION's wheel (downloaded once with PYTHON's pip into
# CACHE/VERSION, lib.sh's vllm_wheel) extracted to CACHE/x/VERSION, where the test peer imports it with
# PYTHONPATH; returns at once when it is there. Extraction goes to a temporary folder first, so a vllm/ folder
# there is a whole release. Sourced after lib.sh by wheels.sh and release.sh (kept out of lib.sh, whose digest
# stamps the peer venv: changing this file rebuilds nothing).
extract_release() {
    local cache=$1 version=$2 python=$3
    local target=$cache/x/$version
    [[ -d $target/vllm ]] && return 0
    vllm_wheel "$cache" "$version" "$python" -m pip --disable-pip-version-check
    rm -rf "$target.tmp"
    mkdir -p "$target.tmp"
    "$python" -m zipfile -e "$WHEEL" "$target.tmp"
    rm -rf "$target"
    mv "$target.tmp" "$target"
}
