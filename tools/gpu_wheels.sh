#!/usr/bin/env bash
# Fills .whl/ (ignored through .git/info/exclude) with what the lent GPU machine lacks to run
# shmserve: it has no package index, so its runtime dependencies travel as cp312 manylinux x86_64
# wheels beside the wheel of shmserve built from this working tree. What that machine already holds
# (torch, numpy, protobuf, grpcio, aiohttp, anyio, h11, click, uvloop, prometheus-client, certifi,
# urllib3, packaging ...: /work/.library/device/KINDS.md, "Python packages already there") is not
# fetched (torch above all never travels), except grpcio and protobuf, named below. Versions are those `make install` resolves here, so the
# GPU run uses the code the CPU tests ran.
#
#   tools/gpu_wheels.sh            # then tools/gpu_run.sh there, in the calls its header lists
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KINDS_MD=${KINDS_MD:-/work/.library/device/KINDS.md}

WHEELS=(
    # pyproject.toml dependencies
    uvicorn==0.54.0 starlette==1.10.0 posix-ipc==1.3.2 watchdog==7.1.0 tritonclient==2.73.0
    orjson==3.13.0 setproctitle==1.3.8 grpcio-health-checking==1.81.1
    # uvicorn[standard]: the C HTTP parser; websockets because uvicorn's auto mode imports it
    httptools==0.9.0 websockets==17.4
    # tritonclient[http,grpc]
    python-rapidjson==1.25 geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2
    zope.event==6.2 zope.interface==8.7 brotli==1.2.1
    # On the machine too, but of a version not known ahead: the broker parses config.pbtxt with
    # tritonclient.grpc's model_config_pb2, which refuses a protobuf runtime older than its gencode
    # (6.33.5) and, through tritonclient.grpc's import of grpc, a grpcio older than 1.81.1.
    grpcio==1.85.3 protobuf==6.33.6
)

rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
"$PY" -m pip wheel -q --no-deps . -w .whl

# Every Requires-Dist (those of tritonclient[http,grpc] included, other extras skipped) must be
# a wheel here or a package already on the machine, and no name may come twice (two versions stop
# the whole install there).
"$PY" - "$KINDS_MD" <<'EOF'
import re, sys, zipfile
from pathlib import Path
try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

kinds = Path(sys.argv[1])
there: set[str] = set()
if kinds.is_file():
    m = re.search(r"Packages: (.*)\.\s*$", kinds.read_text().split("## Python packages already there")[-1], re.M)
    there = {canonicalize_name(n) for n in m.group(1).split(", ")} if m else set()
if not there:
    print(f"warning: no package list at {kinds}: only the wheels' own names count as present", file=sys.stderr)
wanted_extras = {"tritonclient": {"http", "grpc"}}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_system": "Linux",
       "sys_platform": "linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix"}
wheels: dict[str, str] = {}
metas: dict[str, str] = {}
for path in sorted(Path(".whl").glob("*.whl")):
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = canonicalize_name(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip())
    if name in wheels:
        sys.exit(f"two wheels of {name}: {wheels[name]} and {path.name}")
    wheels[name], metas[name] = path.name, meta
missing = []
for name, meta in metas.items():
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        need = False
        for extra in {""} | wanted_extras.get(name, set()):
            if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
                need = True
        dep = canonicalize_name(req.name)
        if need and dep not in wheels and dep not in there:
            missing.append(f"{name} needs {line}")
print("\n".join(sorted(wheels.values())))
if missing:
    sys.exit("missing:\n  " + "\n  ".join(missing))
print(f"{len(wheels)} wheels; every requirement is a wheel here or already on the GPU machine")
EOF
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024)) KiB in .whl ($(awk "BEGIN {printf \"%.1f\", $total / 1048576}") MiB)"
if [ "$total" -gt $((50 * 1024 * 1024)) ]; then
    echo "error: over 50 MiB" >&2
    exit 1
fi

# What each call carries must fit the 64 MiB that travels: the tree (tracked and untracked files
# git does not ignore) plus, per call of tools/gpu_run.sh's header, (1) .ort/part1, (2) .ort/part2
# and .trt (python -m shmserve.tools.gpu_triton), (3) .whl and .triton_examples, which runs gpu_run.sh.
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
size_of() { local total=0 f; for f in "$@"; do [ -e "$f" ] && total=$((total + $(du -sb "$f" | cut -f1))); done; echo $total; }
mib() { awk "BEGIN {printf \"%.1f\", $1 / 1048576}"; }
over=0
n=0
for carried in ".ort/part1" ".ort/part2 .trt" ".whl .triton_examples"; do
    n=$((n + 1))
    # shellcheck disable=SC2086  # (the list is split on purpose)
    size=$((tree + $(size_of $carried)))
    echo "call $n carries [$carried] and the tree ($(mib $tree) MiB): $(mib $size) MiB"
    [ "$size" -le $((64 * 1024 * 1024)) ] || over=1
done
[ -f .ort/part1 ] || echo "(no .ort parts: run python -m shmserve.tools.gpu_onnxruntime for onnxruntime-gpu)"
[ -f .trt/part1 ] || echo "(no .trt parts: run python -m shmserve.tools.gpu_triton for the reference Triton)"
[ -f .triton_examples/simple_http_cudashm_client.py ] || echo "(no .triton_examples: Triton's example clients)"
[ -z "$(ls .trt/part2 .ort/part3 2>/dev/null)" ] || { echo "error: more parts than the plan carries" >&2; exit 1; }
if [ "$over" -ne 0 ]; then
    echo "error: a call would carry over 64 MiB" >&2
    exit 1
fi
