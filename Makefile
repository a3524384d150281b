# Two entry points for a newcomer (see README.md):
#   make up        set everything up, deploy dev onto the cluster twin, answer one request
#   (make preview: the offline preview of the dev stack, the quick path)
#   make test      set everything up, then run the whole test suite (what CI runs)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup system-deps loadtest-tool engine preview test twin-build twin-up twin-down registry-build up down

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# Real servers the tests use: Prometheus (and promtool) and OpenSSH's sshd.
# Installed from Debian when missing; tests start any server they need on loopback.
system-deps:
	bash scripts/install-system-deps

# NVIDIA's aiperf, at the pin in pyproject.toml's `loadtest` extra, in a virtualenv of its own.
LOADTEST_VENV := .venv-loadtest
$(LOADTEST_VENV)/.installed: pyproject.toml $(VENV)/.installed
	python3 -m venv $(LOADTEST_VENV)
	$(LOADTEST_VENV)/bin/pip install --quiet --disable-pip-version-check \
		$$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['loadtest']))")
	touch $@

loadtest-tool: $(LOADTEST_VENV)/.installed

# The real Pulumi engine the tests run: the CLI and the Kubernetes provider, built with Go from
# the modules pinned in engine/*/go.mod into .engine/ (once per pin; scripts/build_engine.py).
engine:
	python3 scripts/build_engine.py

# The cluster twin (README.md, "Cluster twin"): a real control plane and controllers built from
# the Go modules in twin/*/go.mod, on 127.0.0.1. Builds are cached by go.sum in ~/.cache/pdstack/twin-bin.
twin-build: setup
	$(PY) -m twin build

# The OCI registry the image resolver's tests push to (twin/registry/go.mod), and the Prometheus the
# twin's metrics tests run where prometheus-operator asks (twin/prometheus/go.mod), into the same cache.
registry-build: setup
	$(PY) -m twin.build registry prometheus

twin-up: setup
	$(PY) -m twin up

twin-down:
	$(PY) -m twin down

# The platform stack and dev's serving stack by the real Pulumi engine, on the twin (started, or
# the running one) or, with UP_ARGS="--kubeconfig F --context C --inventory I", a cluster of
# your own; then every pod Ready and one request. `down` destroys both and stops the twin
# (scripts/up.py; a killed `make up` is run again, or followed by `make down`).
up: setup system-deps engine
	$(PY) -m scripts.up up $(UP_ARGS)

down: setup
	$(PY) -m scripts.up down $(UP_ARGS)

preview: setup
	$(VENV)/bin/pdctl preview --offline --stack dev

# The twin's tests, in one process since they share one twin (they start it, or reuse one
# `make twin-up` started, and stop what they started), and beside them everything else on every
# core, a test file to a worker: see scripts/run_tests.py for why side by side.
test: setup system-deps loadtest-tool engine twin-build registry-build
	$(PY) scripts/run_tests.py
