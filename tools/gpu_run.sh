#!/usr/bin/env bash
# The one command for the lent GPU machine, run from the repository root with .whl carried
# (tools/gpu_wheels.sh fills it here). Phases, each bounded by `timeout` and none stopping the next:
#   1. install the wheels into /tmp/site (that machine has no package index) and onnxruntime-gpu
#      in place of the machine's onnxruntime (see below), then print the GPU, the versions,
#      onnxruntime's providers and the imports that need those wheels            -> $OUT/env.log
#   2. the GPU, statistics and metrics tests                                      -> $OUT/gpu-tests.log
#   3. Triton's simple_{http,grpc}_cudashm_client.py and simple_{http,grpc}_shm_client.py,
#      unchanged, when .triton_examples/ is carried (they are not ours to commit), then
#      shmserve-perf with inputs and outputs in CUDA regions over HTTP and gRPC  -> $OUT/examples.log
#   4. tools/bench_cudashm.py: a 64 MiB identity through CUDA shm, host path and device path
#                                                                                  -> $OUT/cudashm.json
#   5. tools/bench_gpu.py: ResNet-50 through HTTP and the local client vs torch alone, with one and
#      with two instances (GPU_BENCH_INSTANCES, default "1 2"; empty: no bench)
#                                    -> $OUT/bench-gpu-N.json, $OUT/bench.log, $OUT/server.log
# About 4 minutes when all goes well; at most 9 when every phase runs into its limit.
#
# onnxruntime-gpu is larger than one call may carry: tools/gpu_onnxruntime.py packs it in .ort/part1
# and .ort/part2. A first call carries .ort/part1 and runs `mkdir -p /tmp/ort-parts && cp .ort/part1
# /tmp/ort-parts/`; this script, run by the next call on the same warm machine with .ort/part2
# carried, joins them. Without them the machine's own onnxruntime (a CPU build) stays, and the
# ONNX GPU tests check that a KIND_GPU instance is refused naming the CUDA provider.
# A phase that overruns gets SIGINT first, so pytest's fixtures and the bench stop their servers.
#
# GPU_RUN_TESTS=0 leaves the tests out (a second run for figures only).
# GPU_RUN_DRY=1 rehearses it here on the CPU: no install, the .venv's python, pytest only collects,
# and the bench runs the small net on KIND_CPU for 3 s a path.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# The repository's own shmserve/ holds only the public package's __init__: with the current directory
# at the head of sys.path it would hide the installed shmserve.server, .workers, .shm and .tools.
# The variable reaches every process the tests and the server spawn (they use sys.executable).
export PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/gpu-run-out}
mkdir -p "$OUT"
declare -A rc

if [ -n "${GPU_RUN_DRY:-}" ]; then
    PY=${PY:-.venv/bin/python}
    TEST_MODE=(--collect-only)
    BENCH=(--device cpu --model small --seconds 3 --warmup 1 --floor-seconds 1)
else
    PY=python3
    TEST_MODE=()
    BENCH=(--seconds 10 --warmup 2)
    # The machine's own versions of what the wheels replace or lean on, before /tmp/site hides them.
    python3 -m pip list 2>/dev/null | grep -iE "^(grpcio|protobuf|ml.dtypes|numpy|cuda-bindings|cuda-python|urllib3) " \
        | sed 's/^/machine: /' >"$OUT/env.log"
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    rc[install]=$?
    mkdir -p /tmp/ort-parts
    cp .ort/part* /tmp/ort-parts/ 2>/dev/null
    if [ -f /tmp/ort-parts/part1 ] && [ -f /tmp/ort-parts/part2 ]; then
        # In place of the machine's onnxruntime, beside the NVIDIA pip packages its torch brings,
        # as `pip install onnxruntime-gpu` would put it: the backend loads their CUDA libraries
        # from there (onnxruntime.preload_dlls), with nothing on LD_LIBRARY_PATH.
        site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        rm -rf "$site"/onnxruntime "$site"/onnxruntime-*.dist-info
        cat /tmp/ort-parts/part* | timeout 60 python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
            mode='r|xz').extractall(sys.argv[1], filter='data')" "$site"
        rc[onnxruntime]=$?
    else
        echo "onnxruntime-gpu: .ort parts missing (ls /tmp/ort-parts: $(ls /tmp/ort-parts)); the machine's onnxruntime stays" \
            | tee -a "$OUT/env.log"
        rc[onnxruntime]=1
    fi
    # A shmserve wheel built before the tree's last edit would run old code: the tree's sources win,
    # and the copy is named, so rerun tools/gpu_wheels.sh after editing.
    "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/env.log"
import filecmp, shutil
from pathlib import Path
site = Path("/tmp/site/shmserve")
stale = []
for src, dest in (("shmserve", site), ("server", site / "server"), ("workers", site / "workers"),
                  ("shm", site / "shm"), ("tools", site / "tools")):
    for f in sorted(Path(src).rglob("*.py")):
        target = dest / f.relative_to(src)
        if not target.exists() or not filecmp.cmp(f, target, shallow=False):
            stale.append(str(f))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
print(f"WARNING: the shmserve wheel was stale; copied from the tree: {stale}" if stale
      else "the shmserve wheel matches the tree")
EOF
fi

echo "== environment"
{
    nvidia-smi || echo "(no nvidia-smi)"
    timeout -s INT -k 10 40 "$PY" - <<'EOF'
import importlib.metadata as md, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("numpy", "protobuf", "grpcio", "ml_dtypes", "tritonclient", "uvicorn", "starlette", "cuda-python",
             "cuda-bindings"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "-")
failed = 0
for module in ("shmserve", "tritonclient.http", "tritonclient.utils.cuda_shared_memory",
               "shmserve.server.broker.config"):  # the last: tritonclient.grpc's protobuf schema
    try:
        __import__(module)
        print("import", module, "ok")
    except Exception as exc:  # each import reports on its own
        print("import", module, "FAILED:", repr(exc))
        failed = 1
import shmserve
print("shmserve from", shmserve.__path__[0])
try:
    import onnxruntime
    print("onnxruntime", onnxruntime.__version__, "from", onnxruntime.__file__, onnxruntime.get_available_providers())
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        onnxruntime.preload_dlls()  # as the backend does for a GPU instance
        import numpy as np, onnx
        from onnx import TensorProto, helper
        g = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "g",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        s = onnxruntime.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
        print("onnxruntime CUDA session:", s.get_providers(), s.run(None, {"X": np.array([-1, 2], np.float32)}))
except Exception as exc:  # reported, and the ONNX GPU tests say what it means
    print("onnxruntime FAILED:", repr(exc))
sys.exit(failed)
EOF
} 2>&1 | tee -a "$OUT/env.log"
rc[environment]=$?

echo "== tests"
TESTS=()
for f in tests/test_gpu.py tests/test_statistics.py tests/test_shared_memory.py tests/test_http_api.py \
         tests/test_backends.py tests/test_grpc.py; do
    if [ -f "$f" ]; then TESTS+=("$f"); else echo "($f is absent)"; fi
done
if [ "${GPU_RUN_TESTS:-1}" = 1 ]; then
    timeout -s INT -k 20 200 "$PY" -m pytest -q -rA -p no:cacheprovider "${TESTS[@]}" \
        -k "test_gpu or gpu or cuda or statistics or metrics" --timeout 100 "${TEST_MODE[@]}" 2>&1 \
        | tee "$OUT/gpu-tests.log"
    rc[tests]=$?
else
    echo "(skipped: GPU_RUN_TESTS=0)"
fi

echo "== Triton's example clients, unchanged (.triton_examples, carried; not in git), and shmserve-perf"
if [ -f .triton_examples/simple_http_cudashm_client.py ] && [ -z "${GPU_RUN_DRY:-}" ]; then
    port=18650
    "$PY" -m shmserve --model-repository examples/triton_client_models --http-address 127.0.0.1 \
        --http-port $port --grpc-address 127.0.0.1 --grpc-port $((port + 1)) --metrics-port $((port + 2)) \
        --id gpurunex >>"$OUT/server.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null && break
        sleep 0.1
    done
    {
        for protocol in http grpc; do
            [ $protocol = http ] && url=127.0.0.1:$port || url=127.0.0.1:$((port + 1))
            for example in cudashm shm; do
                timeout 30 "$PY" .triton_examples/simple_${protocol}_${example}_client.py -u $url
                echo "simple_${protocol}_${example}_client.py exit $?"
            done
            timeout -s INT -k 10 40 "$PY" -m shmserve.tools.perf.cli -m simple -i $protocol -u $url \
                --shared-memory cuda --concurrency-range 1:4:3 -p 1000 -r 4 -s 50 -q
            echo "shmserve-perf -i $protocol --shared-memory cuda exit $?"
        done
    } 2>&1 | tee "$OUT/examples.log" | tail -30
    rc[examples]=$(grep -c "exit [^0]" "$OUT/examples.log")
    kill -TERM $server
    wait $server
else
    echo "(skipped: a dry run, or .triton_examples/ was not carried)"
fi

echo "== a 64 MiB identity through CUDA shared memory"
if [ -z "${GPU_RUN_DRY:-}" ]; then
    timeout -s INT -k 20 60 "$PY" -m shmserve.tools.bench_cudashm --server-log "$OUT/server.log" 2>&1 \
        | tee "$OUT/cudashm.json"
    rc[cudashm]=$?
fi

echo "== bench"
for n in ${GPU_BENCH_INSTANCES-1 2}; do
    timeout -s INT -k 20 130 "$PY" -m shmserve.tools.bench_gpu "${BENCH[@]}" --instances "$n" \
        --json "$OUT/bench-gpu-$n.json" --server-log "$OUT/server.log" 2>&1 | tee -a "$OUT/bench.log"
    rc[bench$n]=$?
done

echo "== exit codes (124 or 137: over its time limit)"
status=0
for phase in install onnxruntime environment tests examples cudashm bench1 bench2; do
    if [ -n "${rc[$phase]+x}" ]; then
        echo "$phase: ${rc[$phase]}"
        [ "${rc[$phase]}" -eq 0 ] || status=1
    fi
done
exit $status
