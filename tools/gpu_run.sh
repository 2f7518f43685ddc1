#!/usr/bin/env bash
# The one command for the lent GPU machine, run from the repository root. Phases, each bounded by
# `timeout` and none stopping the next (GPU_RUN_PHASES picks some: "tests examples cudashm bench";
# the install, onnxruntime-gpu, Triton's unpacking and the environment always run):
#   install     the wheels into /tmp/site (that machine has no package index), onnxruntime-gpu in place
#               of the machine's onnxruntime, Triton's tree into /tmp/triton               -> $OUT/env.log
#   environment the GPU, the versions, onnxruntime's providers, the imports, Triton's libpython  -> env.log
#   tests       the GPU, statistics and metrics tests (140 s)                               -> gpu-tests.log
#   examples    Triton's simple_{http,grpc}_{cudashm,shm}_client.py, unchanged (.triton_examples,
#               carried; not in git), against shmserve and against Triton, then shmserve-perf with
#               CUDA regions over HTTP and gRPC (50 s)                                       -> examples.log
#   cudashm     tools/bench_cudashm.py: a 64 MiB identity through CUDA regions, host and device
#               path, 10 calls each, on shmserve and on Triton (65 s)                                      -> cudashm.json
#   bench       tools/bench_gpu_triton.py: ResNet-50 on Triton (Python backend) and on shmserve (the
#               same model.py, and TorchScript), HTTP, gRPC and local, 1 and 2 instances, and torch
#               alone; 1.5 + 4 s a path (330 s)   -> side-by-side.json, bench.log (the markdown table), server.log
#               (a run cut short keeps its rows: python3 -m shmserve.tools.bench_gpu_triton --table-from JSON)
# About 8 minutes when all goes well (the bench about 300 s of it: 13 of its 16 paths took 240 s on an H200); never over 570 s: each phase's limit
# is cut to what is left of the run's 555 s (limit() below; 10 s more for a kill), so a phase that overran shortens the next.
#
# What travels: each call carries the checkout (~3.5 MiB) and at most 64 MiB in all, so the parts go
# in three calls on the same warm machine (it stays warm 30 s after a call; /tmp survives meanwhile):
#   1. carry [".ort/part1"]                 53.4 MiB with the tree:
#        mkdir -p /tmp/ort-parts && cp .ort/part1 /tmp/ort-parts/ && python3 -c "import sys, sysconfig;
#        print(sys.version, sys._base_executable, sysconfig.get_config_var('LIBDIR'))"; ls -l /usr/lib/x86_64-linux-gnu/libpython3*
#        (the last two: whether Triton's stub will find libpython3.12.so.1.0, seen before anything is spent on it)
#   2. carry [".ort/part2", ".trt"]         59.0 MiB:
#        mkdir -p /tmp/ort-parts /tmp/trt-parts && cp .ort/part2 /tmp/ort-parts/ && cp .trt/part* /tmp/trt-parts/
#   3. carry [".whl", ".triton_examples"]   18.9 MiB, timeout_s 600:
#        tools/gpu_run.sh
# (.ort: .venv/bin/python -m shmserve.tools.gpu_onnxruntime; .trt: .venv/bin/python -m shmserve.tools.gpu_triton;
# .whl: tools/gpu_wheels.sh, which checks these sizes.) A phase rerun alone: call 3 again with
# GPU_RUN_PHASES=... before the command, on the same machine while warm (else calls 1 and 2 first).
# Without the .ort parts the machine's onnxruntime (a CPU build) stays and the ONNX GPU tests check
# that a KIND_GPU instance is refused naming the CUDA provider. Triton's Python stub links
# libpython3.12.so.1.0: the machine's if it has one, else the one .trt carries (tools/gpu_triton.py);
# without the .trt parts the Triton rows are errors that say why and everything else runs.
# A phase that overruns gets SIGINT first, so pytest's fixtures and the benchmarks stop their servers.
#
# GPU_RUN_DRY=1 rehearses it here on the CPU: no install, the .venv's python, pytest only collects,
# the examples are the shm (system memory) clients only, cudashm and bench run KIND_CPU (small net,
# 2 s paths, 4 clients), against a Triton unpacked from /tmp/trt311 (.venv/bin/python -m shmserve.tools.gpu_triton
# --python 3.11 --out /tmp/trt311: this host's Python) or else ../shared/tools/reference-triton's venv.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# The repository's own shmserve/ holds only the public package's __init__: with the current directory
# at the head of sys.path it would hide the installed shmserve.server, .workers, .shm and .tools.
# The variable reaches every process the tests and the server spawn (they use sys.executable).
export PYTHONSAFEPATH=1
OUT=${OUT:-/tmp/gpu-run-out}
mkdir -p "$OUT"
PHASES=" ${GPU_RUN_PHASES:-tests examples cudashm bench} "
[ "${GPU_RUN_TESTS:-1}" = 1 ] || PHASES=${PHASES/ tests / }
wants() { [[ $PHASES == *" $1 "* ]]; }
declare -A rc took
started=$SECONDS
stamp() { took[$1]=$((SECONDS - $2)); echo "($1: ${took[$1]} s)"; }
# A phase's limit: its own, or what is left of the whole run's 555 s if less (so the call's 600 s
# hold even when an earlier phase ran into its limit; the bench then keeps the rows it measured).
limit() { local left=$((555 - (SECONDS - started))); echo $(($1 < left ? $1 : (left > 5 ? left : 5))); }

if [ -n "${GPU_RUN_DRY:-}" ]; then
    PY=${PY:-.venv/bin/python}
    TEST_MODE=(--collect-only)
    BENCH=(--device cpu --model small --seconds 2 --warmup 1 --floor-seconds 1 --clients 4)
    CUDASHM=(--device cpu --mib 4)
    TRT_PARTS=${TRT_PARTS:-/tmp/trt311}
    TRITON_ROOT=/tmp/triton-dry
    EXAMPLES=(shm)
    if [ ! -f "$TRT_PARTS/part1" ]; then
        TRITON_ROOT=$(ls -d /tmp/reference-triton/venv/lib/python3*/site-packages 2>/dev/null | head -1)
        TRITON_PY=/tmp/reference-triton/venv/bin/python  # its numpy is 1.x, as the stub needs
    fi
else
    PY=python3
    TEST_MODE=()
    BENCH=(--seconds 4 --warmup 1.5 --floor-seconds 1 --path-timeout 40)
    CUDASHM=(--calls 10)
    TRT_PARTS=/tmp/trt-parts
    TRITON_ROOT=/tmp/triton
    EXAMPLES=(cudashm shm)
    t=$SECONDS
    # The machine's own versions of what the wheels replace or lean on, before /tmp/site hides them.
    python3 -m pip list 2>/dev/null | grep -iE "^(grpcio|protobuf|ml.dtypes|numpy|cuda-bindings|cuda-python|urllib3) " \
        | sed 's/^/machine: /' >"$OUT/env.log"
    timeout 40 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    rc[install]=$?
    mkdir -p /tmp/ort-parts /tmp/trt-parts
    cp .ort/part* /tmp/ort-parts/ 2>/dev/null
    cp .trt/part* /tmp/trt-parts/ 2>/dev/null
    if [ -f /tmp/ort-parts/part1 ] && [ -f /tmp/ort-parts/part2 ]; then
        # In place of the machine's onnxruntime, beside the NVIDIA pip packages its torch brings,
        # as `pip install onnxruntime-gpu` would put it: the backend loads their CUDA libraries
        # from there (onnxruntime.preload_dlls), with nothing on LD_LIBRARY_PATH.
        site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        rm -rf "$site"/onnxruntime "$site"/onnxruntime-*.dist-info
        cat /tmp/ort-parts/part* | timeout 40 python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
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
    stamp install $t
fi
TRITON_PY=${TRITON_PY:-$PY}
TRITON=(--triton-root "$TRITON_ROOT" --triton-python "$TRITON_PY")

echo "== Triton's tree"
t=$SECONDS
if [ -f "$TRT_PARTS/part1" ]; then
    rm -rf "$TRITON_ROOT" && mkdir -p "$TRITON_ROOT"
    cat "$TRT_PARTS"/part* | timeout 30 "$PY" -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, \
        mode='r|xz').extractall(sys.argv[1], filter='data')" "$TRITON_ROOT"
    rc[triton]=$?
    echo "unpacked $(ls "$TRT_PARTS") from $TRT_PARTS into $TRITON_ROOT: exit ${rc[triton]}" | tee -a "$OUT/env.log"
elif [ -z "${GPU_RUN_DRY:-}" ]; then
    echo "Triton: no parts in $TRT_PARTS (ls: $(ls "$TRT_PARTS")): its rows will be errors" | tee -a "$OUT/env.log"
    rc[triton]=1
fi
# Whether the stub can run: the libpython it links, found where tools/triton_process.py looks.
timeout 20 "$PY" - "$TRITON_ROOT" "$TRITON_PY" <<'EOF' 2>&1 | tee -a "$OUT/env.log"
import sys
from pathlib import Path
from shmserve.tools.triton_process import libpython_dir, python_facts, stub_version
root, python = Path(sys.argv[1]), sys.argv[2]
facts = python_facts(python)
found = libpython_dir(facts, root / "triton-lib")
print(f"Triton: tritonserver {'present' if (root / 'pytriton/tritonserver/bin/tritonserver').exists() else 'MISSING'}"
      f" in {root}; its stub links Python {stub_version(root)}; {python} is {facts['version']}; "
      + (f"libpython{facts['version']}.so.1.0 in {found}"
         + (" (the one carried in .trt: the machine has none)" if found.name == "triton-lib" else "") if found else
         f"libpython{facts['version']}.so.1.0 NOT FOUND (LIBDIR {facts['libdir']}, {facts['base_prefix']}/lib, "
         "/usr/lib/x86_64-linux-gnu, triton-lib): the Triton rows will be errors"))
EOF
stamp triton $t

echo "== environment"
t=$SECONDS
{
    nvidia-smi || echo "(no nvidia-smi)"
    timeout -s INT -k 5 30 "$PY" - <<'EOF'
import importlib.metadata as md, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("numpy", "protobuf", "grpcio", "ml_dtypes", "tritonclient", "uvicorn", "starlette", "cuda-python",
             "cuda-bindings", "torchvision"):
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
stamp environment $t

if wants tests; then
    echo "== tests"
    t=$SECONDS
    TESTS=()
    for f in tests/test_gpu.py tests/test_statistics.py tests/test_shared_memory.py tests/test_http_api.py \
             tests/test_backends.py tests/test_grpc.py; do
        if [ -f "$f" ]; then TESTS+=("$f"); else echo "($f is absent)"; fi
    done
    timeout -s INT -k 10 "$(limit 140)" "$PY" -m pytest -q -rA -p no:cacheprovider "${TESTS[@]}" \
        -k "test_gpu or gpu or cuda or statistics or metrics" --timeout 100 "${TEST_MODE[@]}" 2>&1 \
        | tee "$OUT/gpu-tests.log" | tail -40
    rc[tests]=$?
    stamp tests $t
fi

if wants examples; then
    echo "== Triton's example clients, unchanged (.triton_examples, carried; not in git), and shmserve-perf"
    t=$SECONDS
    if [ -f .triton_examples/simple_http_shm_client.py ]; then
        ready=$OUT/triton-examples.ready
        rm -f "$ready"
        # Triton with only the model the examples use; its own venv, ports and stub (tools/triton_process.py).
        "$PY" -m shmserve.tools.triton_process --root "$TRITON_ROOT" --python "$TRITON_PY" --ready-file "$ready" \
            --log "$OUT/server.log" examples/triton_client_models -- --model-control-mode=explicit --load-model=simple &
        triton=$!
        port=18650
        "$PY" -m shmserve --model-repository examples/triton_client_models --http-address 127.0.0.1 \
            --http-port $port --grpc-address 127.0.0.1 --grpc-port $((port + 1)) --metrics-port $((port + 2)) \
            --id gpurunex >>"$OUT/server.log" 2>&1 &
        server=$!
        for _ in $(seq 1 200); do
            curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null && break
            sleep 0.1
        done
        for _ in $(seq 1 200); do
            [ -s "$ready" ] || ! kill -0 $triton 2>/dev/null && break
            sleep 0.1
        done
        {
            targets=("shmserve http 127.0.0.1:$port" "shmserve grpc 127.0.0.1:$((port + 1))")
            if [ -s "$ready" ]; then
                read -r triton_http triton_grpc <"$ready"
                targets+=("triton http $triton_http" "triton grpc $triton_grpc")
            else
                echo "Triton did not start (see server.log): its examples are left out; exit 1"
            fi
            for target in "${targets[@]}"; do
                read -r name protocol url <<<"$target"
                for example in "${EXAMPLES[@]}"; do
                    if [ $((SECONDS - t)) -gt 40 ] || [ "$(limit 20)" -lt 20 ]; then  # (the phase's 50 s)
                        echo "$name: simple_${protocol}_${example}_client.py not run: out of time, exit 124"
                        continue
                    fi
                    timeout 15 "$PY" .triton_examples/simple_${protocol}_${example}_client.py -u $url
                    echo "$name: simple_${protocol}_${example}_client.py exit $?"
                done
                if [ $name = shmserve ] && [ -z "${GPU_RUN_DRY:-}" ] && [ $((SECONDS - t)) -lt 30 ]; then
                    timeout -s INT -k 5 15 "$PY" -m shmserve.tools.perf.cli -m simple -i $protocol -u $url \
                        --shared-memory cuda --concurrency-range 1:4:3 -p 1000 -r 3 -s 50 -q
                    echo "shmserve-perf -i $protocol --shared-memory cuda exit $?"
                fi
            done
        } 2>&1 | tee "$OUT/examples.log" | tail -40
        rc[examples]=$(grep -c "exit [^0]" "$OUT/examples.log")
        kill -TERM $server $triton
        wait $server $triton
    else
        echo "(skipped: .triton_examples/ was not carried)"
    fi
    stamp examples $t
fi

if wants cudashm; then
    echo "== a 64 MiB identity through CUDA shared memory, shmserve and Triton"
    t=$SECONDS
    timeout -s INT -k 5 "$(limit 65)" "$PY" -m shmserve.tools.bench_cudashm "${CUDASHM[@]}" "${TRITON[@]}" \
        --server-log "$OUT/server.log" >"$OUT/cudashm.json"
    rc[cudashm]=$?
    cat "$OUT/cudashm.json"
    stamp cudashm $t
fi

if wants bench; then
    echo "== bench: Triton beside shmserve, ResNet-50"
    t=$SECONDS
    # GPU_BENCH_ARGS: more bench flags, e.g. "--instances 2 --servers shmserve-torchscript" for the rows a
    # run cut short (later flags win).
    # shellcheck disable=SC2086
    timeout -s INT -k 15 "$(limit 330)" "$PY" -m shmserve.tools.bench_gpu_triton "${BENCH[@]}" "${TRITON[@]}" ${GPU_BENCH_ARGS:-} \
        --json "$OUT/side-by-side.json" --server-log "$OUT/server.log" 2>&1 | tee "$OUT/bench.log"
    rc[bench]=$?
    stamp bench $t
fi

echo "== exit codes (124 or 137: over its time limit) and seconds"
status=0
for phase in install onnxruntime triton environment tests examples cudashm bench; do
    if [ -n "${rc[$phase]+x}" ]; then
        echo "$phase: ${rc[$phase]} (${took[$phase]:-?} s)"
        [ "${rc[$phase]}" -eq 0 ] || status=1
    fi
done
echo "total: $((SECONDS - started)) s"
exit $status
