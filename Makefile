# The two commands of the README: `make serve` and `make test`. Both create the venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test install container-tools clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned to the CPU build that lies on this machine's disk; a looser pin downloads gigabytes.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/shmserve --model-repository=model_repository --http-port=8000 --metrics-port=8002

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
test: $(STAMP) container-tools
	$(PY) -m pytest -q --durations=15 --durations-min=10 tests

clean:
	rm -rf $(VENV) build *.egg-info
