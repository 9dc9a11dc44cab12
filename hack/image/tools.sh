#!/usr/bin/env bash
# The image build's tools, from Debian's archive: mmdebstrap (the root file system), umoci (the OCI layout),
# skopeo (copies between layouts, and pushes). Idempotent: installs only what is missing.
set -euo pipefail
missing=()
for tool in mmdebstrap umoci skopeo; do command -v "$tool" >/dev/null || missing+=("$tool"); done
# mmdebstrap's merged-/usr hook and `unshare` (util-linux) are used as well; both come with the above on bookworm.
[ ${#missing[@]} -eq 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "need root to apt-get install ${missing[*]}" >&2; exit 2; }
echo "installing ${missing[*]} from Debian's archive"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
