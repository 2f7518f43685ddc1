# The two commands of the README: `make serve` and `make test`. Both create the venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Serving: the package, onnxruntime for model_repository/'s ONNX model, scikit-learn for the
# README's digits client. The tests add the test extra on top (pytest, moto, schemathesis ...).
SERVE_STAMP := $(VENV)/.installed-serve
SERVE_EXTRAS := onnx,examples
TEST_STAMP := $(VENV)/.installed-test
# torch, pinned. Where it comes from: empty means pip's own indexes, where a plain `pip install
# torch` on Linux x86_64 is the CUDA build (gigabytes, with NVIDIA's libraries); the README says
# when to pass TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu for the CPU build instead
# (about 200 MB). An index set up with the CPU build (as in CI) needs nothing here.
# Flags added to the server's command line by `make serve`, after its own (so a port given here
# wins): `make serve SERVE_FLAGS='--http-port 9000 --grpc-port 9001 --metrics-port 9002'`, where
# another server (Triton's, say) holds 8000-8002.
SERVE_FLAGS ?=
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
TORCH_FROM := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL) --extra-index-url https://pypi.org/simple)
# pip's progress, one line per package it collects, downloads or installs; its whole output goes to
# $(VENV)/pip.log, whose end is shown when a step fails.
SHELL := bash
.SHELLFLAGS := -o pipefail -ec
PIP_LOG := $(VENV)/pip.log
PIP = $(PY) -m pip install $(1) >>$(PIP_LOG) 2>&1 || { tail -n 30 $(PIP_LOG); echo "make: pip failed; its output: $(PIP_LOG)"; exit 1; }
PIP_SHOWN = $(PY) -m pip install $(1) 2>&1 | tee -a $(PIP_LOG) \
	| { grep --line-buffered -E '^ *(Collecting|Downloading|Installing collected|Successfully installed)' || true; } \
	|| { tail -n 30 $(PIP_LOG); echo "make: pip failed; its output: $(PIP_LOG)"; exit 1; }

.PHONY: serve test install container-tools clean

$(SERVE_STAMP): pyproject.toml shm/truncation_guard.c
	@test -x $(PY) || { echo "make: creating the virtual environment $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: [1/3] upgrading pip"
	@: > $(PIP_LOG)
	@$(call PIP,--upgrade pip)
	@echo "make: [2/3] torch $(TORCH_VERSION)$(if $(TORCH_INDEX_URL), from $(TORCH_INDEX_URL))"
	@$(call PIP_SHOWN,$(TORCH_FROM) torch==$(TORCH_VERSION))
	@echo "make: [3/3] shmserve and what serving needs (extras $(SERVE_EXTRAS))"
	@$(call PIP_SHOWN,-e '.[$(SERVE_EXTRAS)]')
	@touch $@

# The test extra, under tests/constraints.txt: versions known to resolve together (see its header).
$(TEST_STAMP): $(SERVE_STAMP) tests/constraints.txt
	@echo "make: the test extra (pytest, moto, schemathesis, ...)"
	@$(call PIP_SHOWN,-c tests/constraints.txt -e '.[test]')
	@touch $@

install: $(TEST_STAMP)

serve: $(SERVE_STAMP)
	@echo "make: starting shmserve on model_repository/ (HTTP :8000, gRPC :8001, metrics :8002$(if $(SERVE_FLAGS), unless SERVE_FLAGS says otherwise); Ctrl-C stops it)"
	$(VENV)/bin/shmserve --model-repository=model_repository --http-port=8000 --metrics-port=8002 $(SERVE_FLAGS)

# tests/test_container.py builds and runs the image (Dockerfile) with Debian's podman, from a base
# image it makes with debootstrap: installed here when missing, where apt-get can (as root).
CONTAINER_TOOLS := podman runc debootstrap
container-tools:
	@if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(CONTAINER_TOOLS); \
		else \
			echo "tests/test_container.py needs $(CONTAINER_TOOLS): install them (apt-get, as root)"; \
		fi; \
	fi

# The suite prints its duration (pytest's closing line) and each test slower than 10 s.
test: $(TEST_STAMP) container-tools
	$(PY) -m pytest -q --durations=15 --durations-min=10 tests

clean:
	rm -rf $(VENV) build *.egg-info shm/_truncation_guard*.so
