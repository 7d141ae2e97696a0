# The two commands of the README. Both set up .venv on a fresh machine first.
#   make check  - the main job: `kvcore check` on the default preset (DeepSeek-V4 + MTP)
#   make test   - ruff, mypy and the whole test suite (tests/ and proofs/)

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvcore-installed
# torch 2.13.0 CPU is on this machine's disk; any other request pulls CUDA wheels.
TORCH  ?= torch==2.13.0
JOBS   ?= 2

.PHONY: check test lint typecheck setup clean bench

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py native/build_native.py native/kvcore_copy.c native/kvcore_copy.h
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "setuptools>=68" wheel "cffi>=1.17"
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

check: $(STAMP)
	$(VENV)/bin/kvcore check

lint: $(STAMP)
	$(VENV)/bin/ruff check spec kvcore tests proofs benchmarks

typecheck: $(STAMP)
	MYPY=$(abspath $(VENV))/bin/mypy tools/typecheck.sh

test: lint typecheck
	$(PY) -m pytest -n $(JOBS) -p no:cacheprovider tests proofs

bench: $(STAMP)
	$(PY) benchmarks/bench_scheduler.py
	$(PY) benchmarks/bench_copy.py

clean:
	rm -rf $(VENV) build *.egg-info kvcore/*.so
