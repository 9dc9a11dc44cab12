# shellcheck shell=bash
# What the vLLM venv scripts share (sourced by hack/vllm/venv.sh, engine-venv.sh and wheels.sh, under
# `set -euo pipefail`): the stamp that lets a rerun with nothing changed return at once, pip runs that stay
# quiet unless they fail, the venv itself over the pinned CPU torch, and vLLM's release wheels downloaded once.

TORCH_PIN=torch==2.13.0
# The repository has an operator/ folder; with the working directory on sys.path (python -m, python -c) it would
# shadow the standard library's operator module.
export PYTHONSAFEPATH=1

# venv_current VENV DIGEST: true when VENV is whole and was built from the inputs whose digest is DIGEST.
venv_current() {
    [[ -f $1/.installed && $(cat "$1/.installed") == "$2" && -x $1/bin/python ]]
}

# run CMD...: CMD with its output kept in a log, whose last 40 lines are shown only if it fails (exit 1);
# VLLM_VENV_VERBOSE=1 shows all of it as it runs.
run() {
    if [[ ${VLLM_VENV_VERBOSE:-0} == 1 ]]; then
        "$@"
    elif ! "$@" >>"$VENV_LOG" 2>&1; then
        echo "${0##*/}: failed: $*" >&2
        tail -n 40 "$VENV_LOG" >&2
        exit 1
    fi
}

# venv_start VENV PYTHON: VENV created with PYTHON if it is missing, unstamped until venv_done, hidden from
# git, with the pinned CPU torch installed; sets PIP, the venv's pip command.
venv_start() {
    VENV_LOG=$(mktemp)
    trap 'rm -f "$VENV_LOG"' EXIT
    rm -f "$1/.installed"
    [[ -x $1/bin/python ]] || run "$2" -m venv "$1"
    # A venv in the repository root that git must not see (the repository's .gitignore is not ours to change).
    echo '*' >"$1/.gitignore"
    PIP=("$1/bin/python" -m pip --disable-pip-version-check)
    # The CPU torch, pinned, never unpinned (the machine's pip config finds the local CPU wheel).
    run "${PIP[@]}" install --quiet "$TORCH_PIN"
}

# venv_done VENV DIGEST: VENV stamped as built from DIGEST's inputs.
venv_done() {
    echo "$2" >"$1/.installed"
}

# vllm_wheel CACHE VERSION PIP...: sets WHEEL to vLLM VERSION's wheel in CACHE/VERSION, downloaded there with
# the command PIP... (prefix it with `run` to log it) the first time.
vllm_wheel() {
    local cache=$1 version=$2
    shift 2
    local wheel_dir=$cache/$version wheels
    shopt -s nullglob
    wheels=("$wheel_dir"/vllm-"$version"-*.whl)
    if (( ${#wheels[@]} == 0 )); then
        mkdir -p "$wheel_dir"
        "$@" download --quiet --no-deps "vllm==$version" -d "$wheel_dir"
        wheels=("$wheel_dir"/vllm-"$version"-*.whl)
    fi
    shopt -u nullglob
    WHEEL=${wheels[0]}
}
