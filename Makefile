# Every target runs inside the project-local virtualenv at .venv, created on first use.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# The venv is rebuilt whenever the dependency list changes.
VENV_STAMP := $(VENV)/.stamp-$(shell sha1sum pyproject.toml | cut -c1-12)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help venv lint test disk-check-test unit demo demo-stop crd clean tools cluster-up cluster-down

help:
	@echo "make demo   - local control plane + operator + built-in model, end to end"
	@echo "make test   - lint and every test (builds what is missing)"
	@echo "make cluster-up / cluster-down - local control plane (kubeconfig: .cluster/kubeconfig)"
	@echo "make demo-stop - stop the demo operator and delete the local cluster"
	@echo "make images-local - runtime (CPU) and operator images built here, no registry (.cache/images/)"
	@echo "make e2e-kind - kind end to end here: Docker engine, node image built locally, up.sh and its tests"

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[runtime,rdma,test]'
	@rm -f $(VENV)/.stamp-* && touch $@

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

unit: venv
	$(BIN)/pytest -m "not cluster"

test: disk-check-test venv lint tools
	$(BIN)/pytest

# A fresh clone's `make test` writes about 22 GB into these (docs/BENCHMARKS.md): refuse at once,
# with what is free and needed, rather than fail after 40 minutes with "No space left on device".
disk-check-test:
	@$(PYTHON) e2e/disk_check.py --gb 22 --what "make test" $(VENV) .cache/images e2e/cluster/bin .cluster

# The chart ships the same file (a test checks they are equal).
crd: venv
	$(BIN)/sovereign-operator crd > crds/sovereign.ai_llmdeployments.yaml
	cp crds/sovereign.ai_llmdeployments.yaml charts/sovereign/crds/

# Go-built control-plane binaries in e2e/cluster/bin (rebuilt only when the pins change).
tools:
	e2e/cluster/build.sh

cluster-up: tools
	e2e/cluster/cluster.sh up

cluster-down:
	e2e/cluster/cluster.sh down

demo: venv tools
	e2e/demo.sh

demo-stop:
	e2e/demo.sh stop

# The cluster first: its real node runs as root with state under .cluster.
clean:
	-e2e/cluster/cluster.sh down
	-e2e/kind/local/engine.sh stop
	rm -rf $(VENV) .cache .cluster

# The same images built on this machine without a registry or Docker (root: debootstrap), from the
# packages in .venv; archives in .cache/images/, cached by layer (a warm run is a no-op).
.PHONY: images-local
images-local: venv
	IMAGE_REPO=$(IMAGE_REPO) IMAGE_TAG=$(IMAGE_TAG) e2e/images/build.sh

# The kind end-to-end path (e2e/kind/up.sh and `up.sh test`) on this machine with no registry: a Docker
# engine started here if none runs, kind and its node image built from pinned modules and Debian packages,
# the images above loaded into the cluster (e2e/kind/local/run.sh). Not part of `make test`.
.PHONY: e2e-kind
e2e-kind: venv tools
	e2e/kind/local/run.sh

# Container images (needs a Docker engine). IMAGE_TAG defaults to the package version.
IMAGE_REPO ?= ghcr.io/sovereign-ai
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
.PHONY: images
images:
	docker build -f images/operator.Dockerfile -t $(IMAGE_REPO)/sovereign-operator:$(IMAGE_TAG) .
	docker build -f images/runtime.Dockerfile -t $(IMAGE_REPO)/sovereign-runtime:$(IMAGE_TAG) .
