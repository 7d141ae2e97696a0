# The two commands of the README. Both set up .venv on a fresh machine first.
#   make check  - the main job: `kvcore check` on the default preset (DeepSeek-V4 + MTP)
#   make test   - ruff, mypy and the whole test suite (tests/ and proofs/)
#   make wheel-check - build the wheel, install it in a fresh venv, use it from outside the
#                      checkout (.ci/run runs it after make test)
#   make mutate      - mutation score of the tests and of `kvcore check` (tools/mutate.py;
#                      slow, so not in CI: MUTANTS=60 SEED=0 by default)

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvcore-installed
# torch 2.13.0 CPU is on this machine's disk; any other request pulls CUDA wheels.
TORCH  ?= torch==2.13.0
JOBS   ?= 2
# The mutation tool lives in its own venv, so it never changes the pinned test tools.
MUTATE_VENV := build/mutate-venv
COSMIC_RAY  ?= cosmic-ray==8.7.0
MUTANTS     ?= 60
SEED        ?= 0

.PHONY: check test lint typecheck setup clean bench mutate wheel-check

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py native/build_native.py native/kvcore_copy.c native/kvcore_copy.h \
          native/kvcore_scan.c native/kvcore_index.c
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

mutate: $(STAMP)
	test -x $(MUTATE_VENV)/bin/cosmic-ray || { python3 -m venv $(MUTATE_VENV) && \
	  $(MUTATE_VENV)/bin/python -m pip install -q "$(COSMIC_RAY)"; }
	$(PY) tools/mutate.py --sample $(MUTANTS) --seed $(SEED)

wheel-check:
	tools/wheel_check.sh

bench: $(STAMP)
	$(PY) benchmarks/bench_scheduler.py
	$(PY) benchmarks/bench_copy.py

clean:
	rm -rf $(VENV) build *.egg-info kvcore/*.so
