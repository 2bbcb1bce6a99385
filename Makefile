# autopar: `make demo` and `make test` set everything up on a fresh machine.
#
# Both create .venv when it is missing, install the CPU build of torch 2.13.0 first
# (the wheel on this machine's disk where pip's find-links holds it, else PyTorch's CPU
# wheel index for that one install: never a CUDA build), then `pip install -e '.[dev]'`.
# The install re-runs when pyproject.toml changes (stamp file in .venv).

PYTHON          ?= python3
VENV            ?= .venv
PY              := $(VENV)/bin/python
PIP             := $(PY) -m pip --disable-pip-version-check
STAMP           := $(VENV)/.autopar-installed
TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TEST_TIMEOUT    ?= 300
# two pytest workers (pytest-xdist), each test file on one of them (its module fixtures, e.g.
# one torchrun launch for many cases, run once): most of the suite's time is one process
# planning or waiting on its ranks, so two share the 2 cores (a fresh clone on this 2-core
# machine, both runs beside other work: 38 min with two workers, 44 serially;
# TEST_WORKERS=0 runs serially)
TEST_WORKERS    ?= 2
# tests marked slow (minutes each: the torchrun restart chain of tests/test_faults.py) run
# with `make test TEST_MARKS=`; the default leaves them out to keep the suite near 30 min
TEST_MARKS      ?= not slow
PYTEST_ARGS     ?=

# The demo is `python -m autopar demo` once the CLI exists, else examples/demo.py.
ifneq ($(and $(wildcard autopar/cli.py),$(wildcard autopar/__main__.py)),)
DEMO_CMD := $(PY) -m autopar demo
else
DEMO_CMD := $(PY) examples/demo.py
endif

.PHONY: demo test venv clean-venv sysdeps

demo: $(STAMP)
	$(DEMO_CMD)

test: $(STAMP) sysdeps
	$(PY) -m pytest -q -p no:cacheprovider --timeout=$(TEST_TIMEOUT) -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "$(TEST_MARKS)" $(PYTEST_ARGS)

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, so the local CPU file satisfies `torch>=2.13` before pip resolves the
# project's dependencies (a bare `torch` from PyPI is a multi-GB CUDA build).
$(STAMP): pyproject.toml setup.py | $(PY)
	@if $(PY) -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null; then \
	  echo "torch $(TORCH_VERSION) already in $(VENV)"; \
	elif $(PIP) install -q --dry-run --no-index --no-deps torch==$(TORCH_VERSION) >/dev/null 2>&1; then \
	  echo "installing torch $(TORCH_VERSION) from the local wheel (pip find-links)"; \
	  $(PIP) install --no-index --no-deps torch==$(TORCH_VERSION) && \
	  $(PIP) install torch==$(TORCH_VERSION); \
	else \
	  echo "no local torch $(TORCH_VERSION) wheel: installing the CPU build from $(TORCH_CPU_INDEX)"; \
	  $(PIP) install --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION); \
	fi
	$(PIP) install -e '.[dev]'
	# torchtitan 0.3 (pyproject's `titan` extra): its Llama 3 for tests/test_titan.py, its
	# trainer for tests/test_titan_trainer.py (autopar.integrations.torchtitan). No torch is
	# pulled (none of its dependencies pins one); its model modules import triton, which it
	# does not declare: --no-deps, the CPU build never runs it. Optional: the tests skip without
	$(PIP) install -q torchtitan==0.3.0 && $(PIP) install -q --no-deps triton==3.7.1 \
	  || echo "could not install torchtitan: tests/test_titan*.py will say they are skipped"
	@touch $@

# Optional system packages for the pictures and the HTML render test: Graphviz's `dot`
# (else SVG/PNG use autopar's own layout) and Chromium (else that one test says it is
# skipped and why). Tried once per venv, as root with apt-get only; never fatal.
SYSDEPS_STAMP := $(VENV)/.sysdeps-tried
sysdeps: $(SYSDEPS_STAMP)
$(SYSDEPS_STAMP): | $(PY)
	@if command -v dot >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing graphviz and chromium (optional)"; \
	  (timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 600 \
	    apt-get install -y -qq --no-install-recommends graphviz chromium >/dev/null) \
	    || echo "could not install graphviz/chromium: those tests fall back or skip"; \
	else echo "not root or no apt-get: graphviz/chromium not installed (optional)"; fi
	@touch $@

clean-venv:
	rm -rf $(VENV)
