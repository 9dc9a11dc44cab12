#!/usr/bin/env bash
# A real one-node Kubernetes v1.20.2 cluster on this machine: the control plane of hack/control-plane.sh (its own
# state and ports), a kubelet, kube-scheduler and kube-proxy built from the same Debian source, containerd + runc
# with the cgroupfs driver, CNI (bridge, host-local, loopback, portmap) on a bridge of its own, a container
# registry on loopback that containerd pulls from, and cluster DNS.
#
# The one stand-in: cluster DNS. No registry here ships CoreDNS or kube-dns, so a real DNS server (dnsmasq)
# answers for cluster.local from a hosts file that a small watcher (rig/node_dns.py, "the DNS watcher stand-in")
# writes from the API server's Services and Endpoints (which carry the StatefulSet pods' hostnames).
#
#   bash hack/node.sh install      # idempotent: apt packages, node binaries (cached), containerd, registry, pause
#   bash hack/node.sh up           # install if needed, then start everything (a no-op when already up)
#   bash hack/node.sh up --nodes 2 # the same, and a second node (disagg-node-2) in its own network namespace
#   eval "$(bash hack/node.sh env)"   # KUBECONFIG, PATH (kubectl, helm), DISAGG_REGISTRY
#   bash hack/node.sh status | down | paths
#   bash hack/node.sh restart-kubelet   # the kubelet stopped and started again; its containers keep running
#
# `down` stops every process `up` started, by PID, and puts back what the node changed on the host: sysctls (the
# kubelet's kernel tunables, forwarding, bridge netfilter, route_localnet), the KUBE-* and CNI-* iptables chains
# and the rules that jump to them, the mounts under the state folder, the pods' network namespaces, the bridge,
# the kubepods cgroups, and the folders the kubelet creates outside its root. Settings (environment):
# DISAGG_NODE_STATE (default /tmp/disagg-node), DISAGG_NODE_ETCD_PORT, DISAGG_NODE_ETCD_PEER_PORT,
# DISAGG_NODE_APISERVER_PORT, DISAGG_REGISTRY_PORT, DISAGG_CACHE, DISAGG_NODE_DISK_GIB (the free disk `up`
# asks for, default 10).
#
# A second node (`up --nodes 2`) gets its own network namespace with its own node address behind a veth pair,
# its own containerd (two kubelets on one containerd would remove each other's sandboxes), kubelet (its own
# cgroup root: a kubelet kills the processes of pod cgroups it does not know under its root) and kube-proxy,
# and a mount namespace shared by its kubelet and containerd in which /var/log/pods, /var/log/containers and
# /var/lib/kubelet are its own (a kubelet's log GC removes the log folders of pods it does not know, and the
# paths are fixed). The registry then listens on the first node's address, which both nodes reach.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CP=$ROOT/hack/control-plane.sh
CACHE=${DISAGG_CACHE:-$HOME/.cache/disagg}
PREFIX=$CACHE/k8s-1.20.2
BIN=$PREFIX/bin
# containerd and the registry come from Debian's debs unpacked here (`apt-get install` would start their
# services on a systemd host); the pause image is built here from the kubernetes tree's pause.c.
NODE_CACHE=$PREFIX/node
NODE_ROOT=$NODE_CACHE/root
PAUSE_LAYOUT=$NODE_CACHE/pause-oci
PAUSE_TAG=3.2

STATE=${DISAGG_NODE_STATE:-/tmp/disagg-node}
LOGS=$STATE/logs
PKI=$STATE/pki
SAVED=$STATE/host-saved

# The kubelet evicts pods below EVICTION_DISK free; `up` refuses to start with less than DISK_NEEDED_GIB free on
# the state folder's disk (the registry's copy of the images, containerd's content and unpacked layers, the
# pods' logs: about 7 GB with the vLLM image).
EVICTION_DISK=2Gi
DISK_NEEDED_GIB=${DISAGG_NODE_DISK_GIB:-10}

NODE_NAME=disagg-node
BRIDGE=disagg0
# The node's address is the pod bridge's gateway: pods reach the API server, the kubelet and DNS there, and
# no address outside this machine's own bridge is ever a target.
NODE_IP=10.244.0.1
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/16
KUBERNETES_SERVICE_IP=10.96.0.1
DNS_IP=$NODE_IP
CLUSTER_DOMAIN=cluster.local
# Every port below the ephemeral range (32768-60999 here): a registry on 35000 once failed with "bind: address
# already in use", the API server's own connection to etcd holding 127.0.0.1:35000 as its source port.
REGISTRY_PORT=${DISAGG_REGISTRY_PORT:-30500}
KUBELET_PORT=10250

# How many nodes: `up --nodes N` says; every other command reads what `up` recorded.
NODES=1
if [[ ${1:-} == up ]]; then
  if [[ ${2:-} == --nodes ]]; then
    [[ ${3:-} =~ ^[12]$ ]] || { echo "[node] --nodes takes 1 or 2" >&2; exit 2; }
    NODES=$3
  fi
elif [[ -f $STATE/nodes ]]; then
  NODES=$(cat "$STATE/nodes")
fi
# One node: the registry on loopback, as it always was. Two: on the first node's address, which the second
# node's containerd reaches from its own network namespace (its loopback is its own).
if ((NODES == 2)); then REGISTRY=$NODE_IP:$REGISTRY_PORT; else REGISTRY=127.0.0.1:$REGISTRY_PORT; fi
# The cluster's pod range: each node routes its own /24; kube-proxy leaves traffic from inside it unmasqueraded.
CLUSTER_CIDR=$POD_CIDR
((NODES == 2)) && CLUSTER_CIDR=10.244.0.0/16

# The second node: a network namespace joined to this one by a veth pair (a /30 of its own), its pod bridge
# inside it with the node address as the gateway, as the first node's.
NODE2_NAME=disagg-node-2
NODE2_NETNS=disagg-node-2
NODE2_IP=10.244.1.1
NODE2_POD_CIDR=10.244.1.0/24
NODE2_BRIDGE=disagg1
NODE2_LINK=disagg-n2
NODE2_LINK_HOST_IP=10.244.255.1
NODE2_LINK_NODE_IP=10.244.255.2
NODE2_CGROUP=disagg-node-2
N2=$STATE/node2
NODE2_MNTNS=$N2/ns/mnt
NODE2_CONTAINERD_SOCK=$N2/containerd/containerd.sock
# The folders a kubelet uses whatever its flags say, private to the second node's mount namespace.
NODE2_PRIVATE_DIRS=(/var/log/pods /var/log/containers /var/lib/kubelet)

export DISAGG_STATE=$STATE/control-plane
export DISAGG_ETCD_PORT=${DISAGG_NODE_ETCD_PORT:-32379}
export DISAGG_ETCD_PEER_PORT=${DISAGG_NODE_ETCD_PEER_PORT:-32380}
export DISAGG_APISERVER_PORT=${DISAGG_NODE_APISERVER_PORT:-31443}
export DISAGG_APISERVER_ADDRESS=$NODE_IP
export DISAGG_SERVICE_CIDR=$SERVICE_CIDR
export DISAGG_KUBERNETES_SERVICE_IP=$KUBERNETES_SERVICE_IP
export DISAGG_AUTHORIZATION_MODE=Node,RBAC
export DISAGG_PRE_APPLY=${DISAGG_PRE_APPLY:-$ROOT/crds}
# The node lifecycle controller takes the not-ready taint off a node that turned Ready; the rest as the tests'.
export DISAGG_KCM_CONTROLLERS='*,-nodeipam,-ttl,-bootstrapsigner,-tokencleaner,-csrsigning,-csrapproving,-csrcleaner,-cloud-node-lifecycle,-persistentvolume-binder,-attachdetach,-persistentvolume-expander,-pvc-protection,-pv-protection,-route,-service' 
KUBECONFIG_FILE=$DISAGG_STATE/admin.kubeconfig
CA_KEY=$DISAGG_STATE/pki/ca.key
CA_CRT=$DISAGG_STATE/pki/ca.crt

CONTAINERD_SOCK=$STATE/containerd/containerd.sock
APT_PACKAGES=(runc containernetworking-plugins dnsmasq-base iptables conntrack skopeo umoci openssl curl
  ca-certificates iproute2)
# The sysctls that the kubelet (its kernel tunables), kube-proxy (route_localnet) and this script change.
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
  net.ipv4.conf.all.route_localnet vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
# Folders the kubelet creates whatever its --root-dir says; removed by `down` only when `up` made them.
HOST_DIRS=(/var/log/pods /var/log/containers /var/lib/kubelet /run/containerd /run/netns /var/lib/cni)
DAEMONS=(containerd registry kubelet kube-scheduler kube-proxy dnsmasq dns-watcher)
NODE2_DAEMONS=(containerd-2 kubelet-2 kube-proxy-2)
((NODES == 2)) && DAEMONS+=("${NODE2_DAEMONS[@]}")
# Prepended to a daemon's command by `launch`: the second node's daemons run inside its namespaces.
LAUNCH_PREFIX=()

log() { printf '[node] %s\n' "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

apt_install_missing() {
  local missing=() p
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  for p in "${missing[@]}"; do
    if ! apt-cache show "$p" >/dev/null 2>&1; then
      log "apt-get update (the package lists lack $p)"
      apt-get -o DPkg::Lock::Timeout=600 update -qq
      break
    fi
  done
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
}

# containerd (1.6, still serving the CRI v1alpha2 a 1.20 kubelet speaks) and docker-registry, unpacked.
install_debs() {
  local dir=$NODE_CACHE/debs deb
  rm -rf "$dir" "$NODE_ROOT"
  mkdir -p "$dir" "$NODE_ROOT"
  if ! apt-cache show containerd docker-registry >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=600 update -qq
  fi
  (cd "$dir" && apt-get -q -o APT::Sandbox::User=root download containerd docker-registry >&2)
  for deb in "$dir"/*.deb; do dpkg -x "$deb" "$NODE_ROOT"; done
  rm -rf "$dir"
}

# The sandbox image: the tree's pause program alone, as an OCI layout (umoci), pushed to the registry by `up`.
build_pause_image() {
  local work=$NODE_CACHE/pause-work
  rm -rf "$work" "$PAUSE_LAYOUT"
  mkdir -p "$work"
  umoci init --layout "$PAUSE_LAYOUT"
  umoci new --image "$PAUSE_LAYOUT:$PAUSE_TAG"
  umoci unpack --image "$PAUSE_LAYOUT:$PAUSE_TAG" "$work/bundle" >/dev/null
  install -m 0755 "$BIN/pause" "$work/bundle/rootfs/pause"
  umoci repack --image "$PAUSE_LAYOUT:$PAUSE_TAG" "$work/bundle"
  umoci config --image "$PAUSE_LAYOUT:$PAUSE_TAG" --config.entrypoint /pause --config.user 65535:65535 \
    --os linux --architecture "$(dpkg --print-architecture)"
  umoci gc --layout "$PAUSE_LAYOUT"
  rm -rf "$work"
}

is_installed() {
  [[ -f $NODE_CACHE/.installed && -x $NODE_ROOT/usr/bin/containerd && -x $NODE_ROOT/usr/bin/docker-registry &&
    -f $PAUSE_LAYOUT/index.json && -x $BIN/kubelet && -x $BIN/kube-proxy && -x $BIN/kube-scheduler ]]
}

cmd_install() {
  apt_install_missing
  bash "$CP" install
  bash "$CP" install-node
  mkdir -p "$NODE_CACHE"
  exec 8>"$NODE_CACHE/.install.lock"
  flock 8
  is_installed && return 0
  [[ -x $NODE_ROOT/usr/bin/containerd && -x $NODE_ROOT/usr/bin/docker-registry ]] || install_debs
  build_pause_image
  {
    "$NODE_ROOT/usr/bin/containerd" --version
    "$NODE_ROOT/usr/bin/docker-registry" --version
    "$BIN/kubelet" --version
  } >"$NODE_CACHE/.installed"
  log "installed: $(tr '\n' ';' <"$NODE_CACHE/.installed")"
}

# --- processes

pid_alive() {
  local f=$STATE/$1.pid pid
  [[ -f $f ]] || return 1
  pid=$(cat "$f")
  [[ -d /proc/$pid ]] || return 1
  local st
  st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ $st != Z ]] || return 1
  # The PID file's binary must still be the one running: a reused PID never counts.
  [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$(cat "$STATE/$1.exe")" ]]
}

# Start a daemon detached from this shell (setsid), so it outlives the caller; its PID and binary go to $STATE.
launch() {
  local name=$1
  shift
  nohup setsid "${LAUNCH_PREFIX[@]}" "$@" >"$LOGS/$name.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$STATE/$name.pid"
  readlink -f "$(command -v "$1")" >"$STATE/$name.exe"
  # $! names the forked shell until nohup, setsid (and nsenter) have exec'd the daemon.
  local i
  for ((i = 0; i < 100; i++)); do
    [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$(cat "$STATE/$name.exe")" ]] && return 0
    [[ -d /proc/$pid ]] || return 0
    sleep 0.05
  done
}

wait_for() {
  local what=$1 seconds=$2 name=$3
  shift 3
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    pid_alive "$name" || die "$name exited while waiting for $what; last log lines:
$(tail -n 30 "$LOGS/$name.log")"
    ((SECONDS < deadline)) || die "timed out after ${seconds}s waiting for $what; see $LOGS/$name.log"
    sleep 0.3
  done
}

stop_one() {
  local name=$1 f=$STATE/$1.pid pid
  [[ -f $f ]] || return 0
  pid=$(cat "$f")
  if pid_alive "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      pid_alive "$name" || break
      sleep 0.2
    done
    if pid_alive "$name"; then
      log "$name (pid $pid) ignored SIGTERM for 10 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$f" "$STATE/$name.exe"
}

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

# --- host changes, recorded before the first change so that `down` can put them back

save_host() {
  [[ -d $SAVED ]] && return 0
  mkdir -p "$SAVED.tmp"
  local s d
  for s in "${SYSCTLS[@]}"; do
    [[ -e /proc/sys/${s//.//} ]] && echo "$s=$(cat "/proc/sys/${s//.//}")" >>"$SAVED.tmp/sysctls"
  done
  for d in "${HOST_DIRS[@]}"; do
    [[ -e $d ]] && echo "$d" >>"$SAVED.tmp/dirs"
  done
  ls /run/netns 2>/dev/null >"$SAVED.tmp/netns" || true
  touch "$SAVED.tmp/sysctls" "$SAVED.tmp/dirs"
  mv "$SAVED.tmp" "$SAVED"
}

restore_host() {
  [[ -d $SAVED ]] || return 0
  local line d t
  # The pods' network namespaces that containerd did not get to remove (it removes them on StopPodSandbox).
  if [[ -d /run/netns ]]; then
    for d in /run/netns/cni-*; do
      [[ -e $d ]] || continue
      grep -qxF "$(basename "$d")" "$SAVED/netns" && continue
      umount "$d" 2>/dev/null || true
      rm -f "$d"
    done
  fi
  ip link del "$BRIDGE" 2>/dev/null || true
  # The second node's namespace takes its veth, bridge, routes, iptables and sysctls with it.
  ip netns del "$NODE2_NETNS" 2>/dev/null || true
  # Every chain kube-proxy, the kubelet and the CNI plugins made: first the rules that jump to them from the
  # built-in chains, then the chains themselves.
  for t in filter nat mangle; do
    { iptables -t "$t" -S 2>/dev/null || true; } | { grep -E -- '^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j (KUBE|CNI)-' || true; } |
      while read -r line; do
        # eval: the rule as iptables printed it, quoted comments included.
        eval "iptables -t $t ${line/-A /-D }" 2>/dev/null || true
      done
    { iptables -t "$t" -S 2>/dev/null || true; } | awk '$1 == "-N" && $2 ~ /^(KUBE|CNI)-/ {print $2}' | while read -r line; do
      iptables -t "$t" -F "$line" 2>/dev/null || true
    done
    { iptables -t "$t" -S 2>/dev/null || true; } | awk '$1 == "-N" && $2 ~ /^(KUBE|CNI)-/ {print $2}' | while read -r line; do
      iptables -t "$t" -X "$line" 2>/dev/null || true
    done
  done
  # The kubelet's QoS cgroups, in every v1 hierarchy and the unified one (they outlive the kubelet).
  for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/"$NODE2_CGROUP"; do
    [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  while IFS='=' read -r line t; do
    [[ -n $line ]] && echo "$t" >"/proc/sys/${line//.//}" 2>/dev/null || true
  done <"$SAVED/sysctls"
  for d in "${HOST_DIRS[@]}"; do
    if ! grep -qxF "$d" "$SAVED/dirs" && [[ -e $d ]]; then
      umount -R "$d" 2>/dev/null || true
      rm -rf "$d"
    fi
  done
  rm -rf "$SAVED"
}

unmount_state() {
  # Deepest first: the pods' volumes, containerd's overlay and shm mounts, the kubelet's bind of its root.
  local m
  awk -v s="$STATE/" 'index($2, s) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}

# --- configuration files

sign_client_cert() {
  local name=$1 subject=$2
  [[ -f $PKI/$name.crt ]] && return 0
  printf 'keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >"$PKI/client.ext"
  openssl req -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -out "$PKI/$name.csr" -subj "$subject" 2>/dev/null
  openssl x509 -req -in "$PKI/$name.csr" -CA "$CA_CRT" -CAkey "$CA_KEY" -CAcreateserial -days 3650 \
    -extfile "$PKI/client.ext" -out "$PKI/$name.crt" 2>/dev/null
  chmod 600 "$PKI/$name.key"
}

write_kubeconfig() {
  local name=$1
  cat >"$STATE/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: disagg-node
  cluster: {server: "https://$NODE_IP:$DISAGG_APISERVER_PORT", certificate-authority: "$CA_CRT"}
users:
- name: $name
  user: {client-certificate: "$PKI/$name.crt", client-key: "$PKI/$name.key"}
contexts:
- name: disagg-node
  context: {cluster: disagg-node, user: $name}
current-context: disagg-node
EOF
}

# containerd's configuration for one node: its root, state and socket under `dir`, its CNI configuration in
# `cni_dir`, the registry (and ghcr.io mirrored from it) in `dir/certs.d`.
write_containerd_config() {
  local dir=$1 cni_dir=$2
  mkdir -p "$dir/certs.d/$REGISTRY" "$dir/certs.d/ghcr.io" "$cni_dir"
  cat >"$dir/config.toml" <<EOF
version = 2
root = "$dir/root"
state = "$dir/state"
[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$REGISTRY/pause:$PAUSE_TAG"
  # Root here lacks CAP_SYS_RESOURCE, so no process may lower its oom_score_adj; the kubelet asks -998 for
  # every sandbox, and runc then fails ("can't get final child's PID from pipe: EOF"). This clamps the request
  # to containerd's own score instead.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$(command -v runc)"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$cni_dir"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$dir/certs.d"
EOF
  # The registry speaks plain HTTP. ghcr.io, where the chart's and examples' images live by default,
  # is mirrored from it, the way a cluster with a pull-through mirror resolves them: examples apply as written.
  cat >"$dir/certs.d/$REGISTRY/hosts.toml" <<EOF
server = "http://$REGISTRY"
[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
  cat >"$dir/certs.d/ghcr.io/hosts.toml" <<EOF
server = "https://ghcr.io"
[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
}

# One node's pod network. Pods get routes to the Services' range (and with two nodes, to the cluster's pod
# range) only, no default route: nothing they send can leave this machine.
write_cni_config() {
  local file=$1 bridge=$2 subnet=$3 gateway=$4 ipam=$5 routes
  routes="{\"dst\": \"$SERVICE_CIDR\"}"
  ((NODES == 2)) && routes="$routes, {\"dst\": \"$CLUSTER_CIDR\"}"
  cat >"$file" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "disagg",
  "plugins": [
    {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$ipam",
              "ranges": [[{"subnet": "$subnet", "gateway": "$gateway"}]],
              "routes": [$routes]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

# A kubelet's serving certificate, for the API server's logs/exec calls (which do not verify it).
sign_serving_cert() {
  local name=$1 node=$2 ip=$3
  [[ -f $PKI/$name-serving.crt ]] && return 0
  printf 'keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:%s,DNS:%s\n' \
    "$ip" "$node" >"$PKI/serving.ext"
  openssl req -newkey rsa:2048 -nodes -keyout "$PKI/$name-serving.key" -out "$PKI/$name-serving.csr" \
    -subj "/CN=$node" 2>/dev/null
  openssl x509 -req -in "$PKI/$name-serving.csr" -CA "$CA_CRT" -CAkey "$CA_KEY" -CAcreateserial -days 3650 \
    -extfile "$PKI/serving.ext" -out "$PKI/$name-serving.crt" 2>/dev/null
}

write_configs() {
  mkdir -p "$STATE/registry" "$STATE/dns" "$PKI"
  write_containerd_config "$STATE/containerd" "$STATE/cni/net.d"
  write_cni_config "$STATE/cni/net.d/10-disagg.conflist" "$BRIDGE" "$POD_CIDR" "$NODE_IP" "$STATE/cni/ipam"
  cat >"$STATE/registry.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog: {disabled: true}
storage:
  filesystem: {rootdirectory: "$STATE/registry"}
  delete: {enabled: true}
http: {addr: "$REGISTRY"}
EOF
  # Pods with dnsPolicy Default get this as their resolv.conf: no nameserver outside the cluster.
  echo "# no upstream DNS for pods on the disagg node" >"$STATE/host-resolv.conf"
  : >"$STATE/dns/cluster.hosts"
  sign_client_cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"
  sign_client_cert kube-proxy "/CN=system:kube-proxy"
  sign_client_cert kube-scheduler "/CN=system:kube-scheduler"
  write_kubeconfig kubelet
  write_kubeconfig kube-proxy
  write_kubeconfig kube-scheduler
  sign_serving_cert kubelet "$NODE_NAME" "$NODE_IP"
  if ((NODES == 2)); then
    write_containerd_config "$N2/containerd" "$N2/cni/net.d"
    write_cni_config "$N2/cni/net.d/10-disagg.conflist" "$NODE2_BRIDGE" "$NODE2_POD_CIDR" "$NODE2_IP" \
      "$N2/cni/ipam"
    sign_client_cert kubelet-2 "/O=system:nodes/CN=system:node:$NODE2_NAME"
    write_kubeconfig kubelet-2
    sign_serving_cert kubelet-2 "$NODE2_NAME" "$NODE2_IP"
  fi
}

# --- up / down

venv_python() {
  [[ -x $ROOT/.venv/bin/python ]] || die "$ROOT/.venv is missing: run make venv (the DNS watcher runs in it)"
  echo "$ROOT/.venv/bin/python"
}

is_up() {
  local d
  [[ $(cat "$STATE/nodes" 2>/dev/null || echo 1) == "$NODES" ]] || return 1
  for d in "${DAEMONS[@]}"; do pid_alive "$d" || return 1; done
  bash "$CP" status >/dev/null 2>&1
}

# Disk thresholds in bytes, not the kubelet's default percentages: the node's images and pods share this
# machine's disk with everything else on it, so "imagefs.available<15%" (38 GB of a 252 GB disk that is 80 %
# full of caches) evicted the vLLM pods and deleted their images as soon as the engine image was unpacked,
# and the pods never stayed up. The same reason turns off image GC by percentage; under real pressure the
# eviction manager still deletes unused images first.
launch_kubelet() {
  local name=$1 node=$2 ip=$3 sock=$4 root=$5
  shift 5
  mkdir -p "$root"
  launch "$name" "$BIN/kubelet" --kubeconfig "$STATE/$name.kubeconfig" --hostname-override "$node" \
    --node-ip "$ip" --address "$ip" --port "$KUBELET_PORT" --read-only-port 0 \
    --healthz-bind-address 127.0.0.1 --healthz-port 30248 \
    --container-runtime remote --container-runtime-endpoint "unix://$sock" \
    --runtime-request-timeout 15m --cgroup-driver cgroupfs --fail-swap-on=false \
    --root-dir "$root" --cert-dir "$root/pki" --volume-plugin-dir "$root/plugins" \
    --tls-cert-file "$PKI/$name-serving.crt" --tls-private-key-file "$PKI/$name-serving.key" \
    --anonymous-auth=false --client-ca-file "$CA_CRT" --authorization-mode Webhook \
    --cluster-dns "$DNS_IP" --cluster-domain "$CLUSTER_DOMAIN" --resolv-conf "$STATE/host-resolv.conf" \
    --serialize-image-pulls=false --node-labels "disagg.io/node=$node" \
    --eviction-hard "memory.available<100Mi,nodefs.available<$EVICTION_DISK,imagefs.available<$EVICTION_DISK" \
    --image-gc-high-threshold 100 --image-gc-low-threshold 99 --v 1 "$@"
}

# --conntrack-*=0: leave the host's conntrack table size and timeouts alone.
launch_kube_proxy() {
  local name=$1 node=$2 ip=$3
  launch "$name" "$BIN/kube-proxy" --kubeconfig "$STATE/kube-proxy.kubeconfig" --hostname-override "$node" \
    --bind-address "$ip" --proxy-mode iptables --cluster-cidr "$CLUSTER_CIDR" \
    --healthz-bind-address 127.0.0.1:30256 --metrics-bind-address 127.0.0.1:30249 \
    --conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0 --v 1
}

launch_containerd() {
  local name=$1 dir=$2
  # containerd finds its shim (containerd-shim-runc-v2) on its PATH.
  (
    PATH=$NODE_ROOT/usr/bin:$PATH
    launch "$name" "$NODE_ROOT/usr/bin/containerd" --config "$dir/config.toml"
  )
  wait_for "$name's socket" 30 "$name" "$NODE_ROOT/usr/bin/ctr" --address "$dir/containerd.sock" version
}

node_ready() {
  "$BIN/kubectl" --kubeconfig "$KUBECONFIG_FILE" get node "$1" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True
}

in_node2_net() { nsenter --net="/run/netns/$NODE2_NETNS" -- "$@"; }

# The second node's host side: its network namespace joined to this one by a veth pair, its pod bridge inside
# it, routes both ways; its cgroup root; and a mount namespace for its kubelet and containerd, held by a bind
# mount of its nsfs file (on a private mount: a namespace file cannot be bound under a shared one).
node2_host_up() {
  ip netns add "$NODE2_NETNS"
  ip link add "$NODE2_LINK" type veth peer name eth0 netns "$NODE2_NETNS"
  ip addr replace "$NODE2_LINK_HOST_IP/30" dev "$NODE2_LINK"
  ip link set "$NODE2_LINK" up
  ip -n "$NODE2_NETNS" link set lo up
  ip -n "$NODE2_NETNS" addr replace "$NODE2_LINK_NODE_IP/30" dev eth0
  ip -n "$NODE2_NETNS" link set eth0 up
  ip -n "$NODE2_NETNS" link add "$NODE2_BRIDGE" type bridge
  ip -n "$NODE2_NETNS" addr replace "$NODE2_IP/24" dev "$NODE2_BRIDGE"
  ip -n "$NODE2_NETNS" link set "$NODE2_BRIDGE" up
  # The first node's pods and address (the API server, DNS, the registry) through the host; the Services'
  # range to the bridge, as on the first node, until kube-proxy's rules take it; no default route.
  ip -n "$NODE2_NETNS" route replace "$CLUSTER_CIDR" via "$NODE2_LINK_HOST_IP" dev eth0
  ip -n "$NODE2_NETNS" route replace "$SERVICE_CIDR" dev "$NODE2_BRIDGE" src "$NODE2_IP"
  ip route replace "$NODE2_POD_CIDR" via "$NODE2_LINK_NODE_IP" dev "$NODE2_LINK"
  # Both are the namespace's own (they go with it).
  in_node2_net sh -c 'echo 1 >/proc/sys/net/ipv4/ip_forward; echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables'

  # A kubelet refuses a --cgroup-root that does not exist; cpuset's must hold CPUs and memory nodes to be used.
  local h d
  for h in /sys/fs/cgroup/*/; do mkdir -p "$h$NODE2_CGROUP"; done
  for h in cpus mems; do
    cat "/sys/fs/cgroup/cpuset/cpuset.$h" >"/sys/fs/cgroup/cpuset/$NODE2_CGROUP/cpuset.$h"
  done

  mkdir -p "$N2/ns"
  mount --bind "$N2/ns" "$N2/ns"
  mount --make-private "$N2/ns"
  touch "$NODE2_MNTNS"
  for d in "${NODE2_PRIVATE_DIRS[@]}"; do mkdir -p "$d" "$N2/private$d"; done
  # Slave: the host's mounts reach it, its own (the pods' volumes, containerd's rootfs) stay in it.
  unshare --mount="$NODE2_MNTNS" --propagation slave bash -c '
    n2=$1
    shift
    for d in "$@"; do mount --bind "$n2/private$d" "$d"; done' _ "$N2" "${NODE2_PRIVATE_DIRS[@]}"
}

node2_up() {
  LAUNCH_PREFIX=(nsenter "--net=/run/netns/$NODE2_NETNS" "--mount=$NODE2_MNTNS" --)
  launch_containerd containerd-2 "$N2/containerd"
  launch_kubelet kubelet-2 "$NODE2_NAME" "$NODE2_IP" "$NODE2_CONTAINERD_SOCK" "$N2/kubelet" \
    --cgroup-root "/$NODE2_CGROUP"
  LAUNCH_PREFIX=(nsenter "--net=/run/netns/$NODE2_NETNS" --)
  launch_kube_proxy kube-proxy-2 "$NODE2_NAME" "$NODE2_IP"
  LAUNCH_PREFIX=()
}

cmd_up() {
  if is_up; then
    log "already up (node $NODE_NAME, KUBECONFIG=$KUBECONFIG_FILE, registry $REGISTRY)"
    return 0
  fi
  is_installed || cmd_install
  local t0=$SECONDS py free_gib
  free_gib=$(($(df --output=avail -k "$(dirname "$STATE")" | tail -n 1) / 1024 / 1024))
  ((free_gib >= DISK_NEEDED_GIB)) ||
    die "$(dirname "$STATE") has $free_gib GiB free; the node needs $DISK_NEEDED_GIB GiB (its registry, containerd's images, the pods' logs; DISAGG_NODE_DISK_GIB)"
  py=$(venv_python)
  # Whatever a half-done earlier run left is stopped and put back first, so `up` always starts clean.
  if [[ -d $STATE ]]; then cmd_down; fi
  trap 'log "up failed; taking down what it started"; cmd_down' EXIT
  mkdir -p "$STATE" "$LOGS"
  echo "$NODES" >"$STATE/nodes"
  save_host

  # The bridge exists before the API server, which binds the node address on it.
  ip link add "$BRIDGE" type bridge 2>/dev/null || true
  ip addr replace "$NODE_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  # Service addresses go to the bridge, never to the default route, even before kube-proxy's rules exist.
  ip route replace "$SERVICE_CIDR" dev "$BRIDGE" src "$NODE_IP"
  echo 1 >/proc/sys/net/ipv4/ip_forward
  # Pod -> Service -> pod on the same bridge: the reply must pass netfilter to be un-DNATed.
  echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
  ((NODES == 2)) && node2_host_up

  bash "$CP" start
  write_configs

  launch registry "$NODE_ROOT/usr/bin/docker-registry" serve "$STATE/registry.yml"
  wait_for "the registry" 30 registry curl -fsS "http://$REGISTRY/v2/"
  skopeo copy --quiet --dest-tls-verify=false "oci:$PAUSE_LAYOUT:$PAUSE_TAG" "docker://$REGISTRY/pause:$PAUSE_TAG"

  launch_containerd containerd "$STATE/containerd"

  launch dnsmasq "$(command -v dnsmasq)" --keep-in-foreground --log-facility=- --conf-file=/dev/null \
    --no-resolv --no-hosts --no-negcache --bind-interfaces --listen-address="$DNS_IP" --port=53 \
    --local="/$CLUSTER_DOMAIN/" --addn-hosts="$STATE/dns/cluster.hosts" --pid-file="$STATE/dns/dnsmasq.pid" \
    --user=root
  launch dns-watcher "$py" -m disagg.rig.node_dns --kubeconfig "$KUBECONFIG_FILE" \
    --hosts "$STATE/dns/cluster.hosts" --dnsmasq-pid "$STATE/dnsmasq.pid" --domain "$CLUSTER_DOMAIN"

  launch_kubelet kubelet "$NODE_NAME" "$NODE_IP" "$CONTAINERD_SOCK" "$STATE/kubelet"
  launch kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$STATE/kube-scheduler.kubeconfig" \
    --leader-elect=false --port 0 --secure-port 0 --v 1
  launch_kube_proxy kube-proxy "$NODE_NAME" "$NODE_IP"
  ((NODES == 2)) && node2_up

  wait_for "node $NODE_NAME Ready" 120 kubelet node_ready "$NODE_NAME"
  local d nodes="node $NODE_NAME ($NODE_IP)"
  if ((NODES == 2)); then
    wait_for "node $NODE2_NAME Ready" 120 kubelet-2 node_ready "$NODE2_NAME"
    nodes="nodes $NODE_NAME ($NODE_IP) and $NODE2_NAME ($NODE2_IP, network namespace $NODE2_NETNS)"
  fi
  for d in "${DAEMONS[@]}"; do pid_alive "$d" || die "$d exited: $(tail -n 20 "$LOGS/$d.log")"; done
  trap - EXIT
  log "up in $((SECONDS - t0)) s: $nodes, registry $REGISTRY, KUBECONFIG=$KUBECONFIG_FILE"
}

ctr_k8s() { "$NODE_ROOT/usr/bin/ctr" --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }
ctr2_k8s() { "$NODE_ROOT/usr/bin/ctr" --address "$NODE2_CONTAINERD_SOCK" -n k8s.io "$@"; }

tasks_left() { [[ -n $(ctr_k8s tasks ls -q 2>/dev/null) || -n $(ctr2_k8s tasks ls -q 2>/dev/null) ]]; }

# Kill the tasks a containerd still has (a kubelet that died first), so that its shims exit.
kill_tasks() {
  local ctr=$1 c
  for c in $($ctr tasks ls -q 2>/dev/null); do $ctr tasks kill -s KILL "$c" >/dev/null 2>&1 || true; done
  sleep 1
  for c in $($ctr tasks ls -q 2>/dev/null); do $ctr tasks delete -f "$c" >/dev/null 2>&1 || true; done
}

cmd_down() {
  local t0=$SECONDS
  # No new pods: the scheduler and the controllers go first. Then every pod is deleted while the kubelets and
  # containerds still run, so that containerd tears down each sandbox's network (CNI DEL) and mounts.
  # (The controllers recreate some, but with no scheduler they stay Pending, bound to no node.)
  stop_one kube-scheduler
  if pid_alive kubelet && pid_alive containerd && bash "$CP" status >/dev/null 2>&1; then
    kubectl_admin delete pods --all --all-namespaces --grace-period 0 --force --wait=false >/dev/null 2>&1 || true
    local deadline=$((SECONDS + 60))
    while ((SECONDS < deadline)) && tasks_left; do sleep 0.5; done
  fi
  # The second node's daemons whatever NODES says: `up` takes down what an earlier run left.
  stop_one kubelet
  stop_one kubelet-2
  stop_one kube-proxy
  stop_one kube-proxy-2
  stop_one dns-watcher
  stop_one dnsmasq
  pid_alive containerd && kill_tasks ctr_k8s
  pid_alive containerd-2 && kill_tasks ctr2_k8s
  stop_one containerd
  stop_one containerd-2
  stop_one registry
  # Shims that outlived containerd (they are started detached from it): only ours, found by their socket path.
  local p
  for p in $(pgrep -f "containerd-shim-runc-v2 .*-address ($CONTAINERD_SOCK|$NODE2_CONTAINERD_SOCK)( |$)" \
    2>/dev/null || true); do
    kill -KILL "$p" 2>/dev/null || true
  done
  bash "$CP" teardown >/dev/null 2>&1 || true
  unmount_state
  restore_host
  # The logs outlive the state, for a failed `up` to be read.
  if [[ -d $LOGS ]]; then
    rm -rf "$STATE-logs"
    mv "$LOGS" "$STATE-logs"
  fi
  rm -rf "$STATE"
  log "down in $((SECONDS - t0)) s; host settings put back"
}

cmd_status() {
  local d rc=0
  for d in "${DAEMONS[@]}"; do
    if pid_alive "$d"; then echo "$d: running (pid $(cat "$STATE/$d.pid"))"; else
      echo "$d: stopped"
      rc=1
    fi
  done
  bash "$CP" status || rc=1
  ((rc == 0)) && kubectl_admin get nodes -o wide
  return $rc
}

# The kubelet stopped (SIGTERM) and started again with the same flags, as a node upgrade or a crash does; the
# containers it ran keep running under containerd meanwhile.
cmd_restart_kubelet() {
  is_up || die "the node is not up"
  local before
  before=$(cat "$STATE/kubelet.pid")
  stop_one kubelet
  launch_kubelet kubelet "$NODE_NAME" "$NODE_IP" "$CONTAINERD_SOCK" "$STATE/kubelet"
  wait_for "the new kubelet's health endpoint" 60 kubelet curl -fsS http://127.0.0.1:30248/healthz
  wait_for "node $NODE_NAME Ready" 120 kubelet node_ready "$NODE_NAME"
  log "kubelet restarted: pid $before -> $(cat "$STATE/kubelet.pid"); node $NODE_NAME Ready"
}

cmd_env() {
  printf 'export KUBECONFIG=%q\n' "$KUBECONFIG_FILE"
  # shellcheck disable=SC2016 # $PATH must expand in the caller's shell.
  printf 'export PATH=%q:"$PATH"\n' "$BIN"
  printf 'export DISAGG_REGISTRY=%q\n' "$REGISTRY"
}

cmd_paths() {
  printf 'kubeconfig=%s\nbin=%s\nstate=%s\nregistry=%s\nnode=%s\nnode_ip=%s\ncontainerd=%s\nctr=%s\n' \
    "$KUBECONFIG_FILE" "$BIN" "$STATE" "$REGISTRY" "$NODE_NAME" "$NODE_IP" "$CONTAINERD_SOCK" \
    "$NODE_ROOT/usr/bin/ctr"
  if ((NODES == 2)); then
    printf 'node2=%s\nnode2_ip=%s\nnode2_netns=%s\ncontainerd2=%s\n' "$NODE2_NAME" "$NODE2_IP" "$NODE2_NETNS" \
      "$NODE2_CONTAINERD_SOCK"
  fi
}

main() {
  [[ $(id -u) -eq 0 ]] || die "hack/node.sh runs as root (containerd, the kubelet, iptables, mounts)"
  case ${1:-} in
    install) cmd_install ;;
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    paths) cmd_paths ;;
    restart-kubelet) cmd_restart_kubelet ;;
    *)
      echo "usage: $0 install|up [--nodes 1|2]|down|status|env|paths|restart-kubelet" >&2
      exit 2
      ;;
  esac
}

main "$@"; exit
