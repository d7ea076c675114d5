# certblocks: `make demo` and `make test` set everything up on a fresh machine.
#
#   make test      the fast default (a few minutes on 2 cores): every test but those marked slow, interpreter
#                  (Triton kernels in Triton's CPU interpreter), subprocess (tests that start Python processes),
#                  bench (tests of benchmarks/) and peer (timm's own test suite on our models); pyproject.toml
#                  registers the markers, tests/conftest.py assigns most of them by path
#   make test-all  every test (what CI runs: .ci/run)
#   make lint      ruff on the sources, tests and benchmarks; mypy on the package (certblocks, kernels, zoo)
#
# PYTEST adds pytest options (make test PYTEST="-x -k attention"); XDIST the parallel workers (XDIST= for one
# process).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.certblocks-installed
PYTEST ?= -q
XDIST  ?= -n 2 --dist loadfile
MARKERS ?= not (slow or interpreter or subprocess or bench or peer)
TYPES  := build/typecheck

.PHONY: install demo test test-all bench readme lint clean

install: $(STAMP)

# torch and torchvision are pinned here (the only pair that imports together on this machine);
# pyproject.toml states ranges. mamba-ssm builds from source without its CUDA extension (tests only).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.14.1 torchvision==0.29.1
	$(PIP) install --quiet -e ".[all,bench,dev]"
	$(PIP) install --quiet packaging wheel ninja setuptools
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE $(PIP) install --quiet --no-build-isolation --no-deps "mamba-ssm>=2.2"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/certblocks demo
	$(VENV)/bin/certblocks certify

test: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "$(MARKERS)" $(PYTEST)

test-all: $(STAMP)
	$(PY) -m pytest $(XDIST) $(PYTEST)

# The CPU figures of benchmarks/RESULTS.md (benchmarks/results/*.md), quick modes (about 25 minutes on 2 cores);
# speed scripts in benchmarks/, experiments in benchmarks/experiments/.
bench: $(STAMP)
	$(PY) benchmarks/bench_budget.py
	$(PY) benchmarks/trace_gpt2.py --repeats 3
	$(PY) benchmarks/bench_selective_scan.py
	$(PY) benchmarks/bench_mamba_block.py --threads 1 --repeats 7
	$(PY) benchmarks/bench_blocks.py
	$(PY) benchmarks/throughput.py --quick --threads 1
	$(PY) benchmarks/tools/sass.py
	$(PY) benchmarks/experiments/overflow_depth.py
	$(PY) benchmarks/experiments/stability.py --quick
	$(PY) benchmarks/experiments/monitor_gpt.py --quick
	$(PY) benchmarks/experiments/enforced_llama.py --quick --threads 1

readme: $(STAMP)
	$(VENV)/bin/certblocks table --update-readme README.md

# mypy reads the installed layout (kernels/ is certblocks.kernels, zoo/ is certblocks.zoo) from a tree of links.
lint: $(STAMP)
	$(PY) -m ruff check certblocks kernels zoo tests benchmarks
	rm -rf $(TYPES) && mkdir -p $(TYPES)/certblocks
	ln -s $(CURDIR)/certblocks/* $(TYPES)/certblocks/
	ln -sfn $(CURDIR)/kernels $(TYPES)/certblocks/kernels
	ln -sfn $(CURDIR)/zoo $(TYPES)/certblocks/zoo
	cd $(TYPES) && $(abspath $(PY)) -m mypy --config-file $(CURDIR)/pyproject.toml --cache-dir $(CURDIR)/build/mypy_cache \
		-p certblocks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
