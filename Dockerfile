# shmserve's container image: docs/deploy.md.
#
#   CPU:  docker build -t shmserve .
#   CUDA: docker build -t shmserve:cuda --build-arg VARIANT=cuda .
#         (the wheels bring the CUDA libraries; the host brings the driver: docs/deploy.md)
#   run:  docker run --shm-size=3g -p 8000-8002:8000-8002 -v $PWD/model_repository:/models:ro shmserve
#
# BASE is any Debian or Ubuntu image; python3 (3.10 or newer), its venv module and tini are
# installed from the distribution when the base lacks them.
ARG BASE=python:3.11-slim
FROM ${BASE}

# cpu: torch's CPU build and onnxruntime; cuda: PyPI's torch (built with CUDA) and onnxruntime-gpu.
ARG VARIANT=cpu
# The README's install (`make install`) pins the same torch.
ARG TORCH_VERSION=2.13.0
# Where torch comes from; empty: by VARIANT (the CPU index for cpu, PyPI for cuda).
ARG TORCH_INDEX_URL=
# For builds behind a proxy or offline mirror: a folder of wheels pip looks in too (a build that
# mounts one: `--volume /opt/wheels:/wheels --build-arg WHEELS=/wheels`), and the CA bundle pip
# trusts (mounted likewise), for pip and the builds it runs. Not PIP_* names: pip would read them
# even when empty.
ARG WHEELS=
ARG CA_BUNDLE=

RUN set -eu; \
    missing=""; \
    command -v python3 >/dev/null || missing="$missing python3"; \
    python3 -c 'import ensurepip, venv' 2>/dev/null || missing="$missing python3-venv"; \
    command -v tini >/dev/null || missing="$missing tini"; \
    if [ -n "$missing" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/shmserve/venv

ENV PATH=/opt/shmserve/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# torch first, in a layer of its own: the largest download, and it changes least.
RUN set -eu; \
    index="$TORCH_INDEX_URL"; \
    case "$VARIANT" in \
        cpu) [ -n "$index" ] || index=https://download.pytorch.org/whl/cpu ;; \
        cuda) [ -n "$index" ] || index=https://pypi.org/simple ;; \
        *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 2 ;; \
    esac; \
    if [ -n "$WHEELS" ]; then export PIP_FIND_LINKS="$WHEELS"; fi; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    pip install --index-url "$index" \
        --extra-index-url https://pypi.org/simple "torch==$TORCH_VERSION"

COPY . /opt/shmserve/src
# A C compiler for the build only, removed after it: shmserve's truncation guard
# (shm/truncation_guard.c, docs/serving.md#security-model), which the last check asks for.
RUN set -eu; \
    case "$VARIANT" in cpu) extra=onnx ;; cuda) extra=onnx-gpu ;; esac; \
    if [ -n "$WHEELS" ]; then export PIP_FIND_LINKS="$WHEELS"; fi; \
    if [ -n "$CA_BUNDLE" ]; then export PIP_CERT="$CA_BUNDLE"; fi; \
    compiler=""; \
    if ! command -v cc >/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev; \
        compiler="gcc libc6-dev"; \
    fi; \
    pip install "/opt/shmserve/src[$extra]"; \
    if [ -n "$compiler" ]; then \
        apt-get purge -y --auto-remove $compiler; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'from shmserve.shm import truncation_guard as t; assert t.available(), "the truncation guard was not built"'; \
    mkdir -p /models /home/shmserve; \
    chown 1000:1000 /home/shmserve

# Triton's image runs as uid 1000 too (KServe's runtimes set runAsUser: 1000); numeric, so that
# Kubernetes' runAsNonRoot can check it.
USER 1000:1000
ENV HOME=/home/shmserve
WORKDIR /opt/shmserve
EXPOSE 8000 8001 8002
# tini is PID 1: it hands SIGTERM to the launcher, which drains (--exit-timeout-secs) and removes
# its shared memory, and it reaps whatever is orphaned inside the container.
ENTRYPOINT ["tini", "--", "shmserve"]
CMD ["--model-repository=/models"]
ENV SHMSERVE_HEALTH_URL=http://127.0.0.1:8000/v2/health/ready
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['SHMSERVE_HEALTH_URL'], timeout=2)"]
