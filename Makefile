# `make verify TP=2` and `make test` work on a fresh clone: the first run creates .venv from the
# CPU pins in constraints/cpu.txt. On a machine whose Python already has torch (a GPU runner),
# pass PYTHON=python3 to use that interpreter instead.
TP ?= 2
CONSTRAINTS := constraints/cpu.txt

ifeq ($(origin PYTHON), undefined)
PYTHON := .venv/bin/python
SETUP := .venv/.installed
else
SETUP := external-setup
endif

.PHONY: verify test test-slow golden lint external-setup

verify: $(SETUP)
	$(PYTHON) -m verify.cli --tp 1,$(TP)

test: $(SETUP)
	$(PYTHON) -m pytest -n 2 -q -m "not slow"

# The tests marked slow (the TP-4 and kernel-fault entries of the bug catalogue).
test-slow: $(SETUP)
	$(PYTHON) -m pytest -n 2 -q -m slow

golden: $(SETUP)
	$(PYTHON) -m verify.cases --write verify/golden

lint: $(SETUP)
	$(PYTHON) -m ruff check freetoken verify tests bench

.venv/.installed: pyproject.toml $(CONSTRAINTS)
	test -x .venv/bin/python || python3 -m venv .venv
	.venv/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	touch $@

external-setup:
	@$(PYTHON) -c "import freetoken, verify, pytest, xdist" 2>/dev/null || \
		$(PYTHON) -m pip install -q -e '.[test]'
