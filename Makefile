# The two commands of the README: `make serve` and `make test`. Both create the venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test install clean

# The compiled modules (setup.py) are rebuilt whenever one of them changes: an editable install puts
# each extension beside its source, and a stale one would run instead of the edited code.
$(STAMP): pyproject.toml setup.py compiled-modules.txt $(shell cat compiled-modules.txt)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the CPU build that lies on this machine's disk; a looser pin downloads gigabytes.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/shmserve --model-repository=model_repository --http-port=8000 --metrics-port=8002

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
