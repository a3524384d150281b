# Two entry points for a newcomer (see README.md):
#   make preview   set everything up, then run the offline preview of the dev stack
#   make test      set everything up, then run the whole test suite (what CI runs)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup system-deps preview test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# Real servers the tests use: Prometheus (and promtool) and OpenSSH's sshd.
# Installed from Debian when missing; tests start any server they need on loopback.
system-deps:
	bash scripts/install-system-deps

preview: setup
	$(VENV)/bin/pdctl preview --offline --stack dev

test: setup system-deps
	$(PY) -m pytest
