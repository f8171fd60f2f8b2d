# `make verify TP=2` and `make test` work on a fresh clone: the first run creates .venv from the
# CPU pins in constraints/cpu.txt. On a machine whose Python already has torch (a GPU runner),
# pass PYTHON=python3 to use that interpreter instead (the package is installed into it if it
# is not there yet).
TP ?= 2
CONSTRAINTS := constraints/cpu.txt

ifeq ($(origin PYTHON), undefined)
PYTHON := .venv/bin/python
SETUP := .venv/.installed
else
SETUP := external-setup
endif

# The GPU gate (`make verify-gpu`, docs/gpu.md). TP sizes: TP=1,2,4 on the command line, else
# every power of two up to GPUS, so each size runs one rank per GPU over NCCL (--oversubscribe
# lets a larger TP share GPUs over gloo). DEVICE=cpu dry-runs the gate on CPU ranks (without the
# GPU kernel tests); PART=bundled, realdims or kernels runs one part of it. The real-dimension
# checkpoint is generated once into REALDIMS.
GPUS ?= 1
DEVICE ?= cuda
PART ?= all
REPORTS ?= reports
REALDIMS ?= $(HOME)/.cache/freetoken/qwen3.5-moe-realdims
comma := ,
tp_upto_1 := 1
tp_upto_2 := 1,2
tp_upto_4 := 1,2,4
tp_upto_8 := 1,2,4,8
ifeq ($(origin TP), command line)
GATE_TP := $(TP)
else
GATE_TP = $(or $(tp_upto_$(GPUS)),$(error GPUS=$(GPUS): expected 1, 2, 4 or 8, or give TP=...))
endif
# Bundled case names, comma separated: those HF can run live, and the quantized ones that it
# cannot (ModelOpt: an hf_quant_config.json; compressed-tensors and HF fp8: a
# quantization_config in config.json), whose reference is their stored golden.
space := $(subst ,, )
case_names = $(subst $(space),$(comma),$(sort $(notdir $(patsubst %/,%,$(dir $(1))))))
quantized_cases := $(sort $(dir $(wildcard freetoken_verify/golden/*/hf_quant_config.json) \
    $(shell grep -l '"quantization_config"' freetoken_verify/golden/*/config.json 2>/dev/null)))
hf_cases := $(filter-out $(quantized_cases),$(dir $(wildcard freetoken_verify/golden/*/config.json)))
# One run of the gate: $(call gate,NAME,ARGS). A failing run is listed in $(REPORTS)/failed and
# the gate goes on to the next; verify-gpu fails at the end if any run failed.
gate = echo "=== $(1): freetoken-verify $(2)"; \
	$(PYTHON) -m freetoken_verify.cli --device $(DEVICE) --oversubscribe --tp $(GATE_TP) $(2) \
	    --report-json $(REPORTS)/$(1).json --junit-xml $(REPORTS)/$(1).xml \
	    --summary-md $(REPORTS)/$(1).md || echo $(1) >> $(REPORTS)/failed

.PHONY: verify verify-gpu test test-slow golden lint external-setup

verify: $(SETUP)
	$(PYTHON) -m freetoken_verify.cli --tp 1,$(TP)

# The nightly gate: on CUDA every GPU test of the tree (pytest -m gpu tests); every
# bundled case in fp32 against its stored golden; in bf16 the unquantized cases against live HF
# on the same GPU and the quantized ones against their stored golden and stored bf16 baseline; the
# real-dimension Qwen3.5-MoE in bf16 and fp32 against HF.
verify-gpu: $(SETUP)
ifeq ($(DEVICE),cuda)
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
	echo "error: DEVICE=cuda but $(PYTHON)'s torch sees no CUDA device; nothing was run or \
	written (DEVICE=cpu dry-runs the gate on CPU ranks)" >&2; exit 2; }
endif
	@mkdir -p $(REPORTS) && rm -f $(REPORTS)/failed
ifeq ($(DEVICE)-$(filter $(PART),all kernels),cuda-$(PART))
	@echo "=== kernels-gpu: pytest -m gpu tests"; \
	    $(PYTHON) -m pytest -q -m gpu tests --require-gpus --junit-xml $(REPORTS)/kernels-gpu.xml || \
	    echo kernels-gpu >> $(REPORTS)/failed
endif
ifneq ($(filter $(PART),all bundled),)
	@$(call gate,bundled-fp32,)
	@$(call gate,bundled-bf16,--dtype bfloat16 --reference hf --checks golden \
	    --model $(call case_names,$(hf_cases)))
	@$(call gate,bundled-quantized-bf16,--dtype bfloat16 --checks golden \
	    --model $(call case_names,$(quantized_cases)))
endif
ifneq ($(filter $(PART),all realdims),)
	@test -f $(REALDIMS)/config.json || \
	    $(PYTHON) -m freetoken_verify.cases --realdims $(REALDIMS) --dtype bfloat16 || \
	    echo realdims-checkpoint >> $(REPORTS)/failed
	@$(call gate,realdims-bf16,--model $(REALDIMS) --dtype bfloat16 --reference hf \
	    --checks golden$(comma)memory$(comma)shards)
	@$(call gate,realdims-fp32,--model $(REALDIMS) --dtype float32 --reference hf --checks golden)
endif
	@if [ -f $(REPORTS)/failed ]; then \
	    echo "verify-gpu: failed: $$(tr '\n' ' ' < $(REPORTS)/failed)"; exit 1; fi
	@echo "verify-gpu: every run passed; reports in $(REPORTS)/"

test: $(SETUP)
	$(PYTHON) -m pytest -n 2 -q -m "not slow"

# The tests marked slow (the TP-4 and kernel-fault entries of the bug catalogue).
test-slow: $(SETUP)
	$(PYTHON) -m pytest -n 2 -q -m slow

golden: $(SETUP)
	$(PYTHON) -m freetoken_verify.cases --write freetoken_verify/golden

lint: $(SETUP)
	$(PYTHON) -m ruff check freetoken freetoken_verify tests bench

.venv/.installed: pyproject.toml $(CONSTRAINTS)
	test -x .venv/bin/python || python3 -m venv .venv
	@echo "installing FreeToken with the CPU pins of $(CONSTRAINTS) into .venv (a few minutes the first time)"
	.venv/bin/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $@

# An interpreter given as PYTHON=...: it must have its own torch (the GPU build of its machine:
# never installed here, where a plain install would pull a CUDA torch); the package is installed
# into it (editable, with the test extra, without build isolation so an offline runner needs
# nothing from the network) if it is not installed there yet.
external-setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "error: PYTHON=$(PYTHON) cannot import \
	torch; install the torch build for this machine first (make never installs one)" >&2; exit 2; }
	@$(PYTHON) -c "import importlib.metadata as m; m.version('freetoken'); \
		import pytest, xdist" 2>/dev/null || \
		$(PYTHON) -m pip install -q --no-build-isolation -e '.[test]'
