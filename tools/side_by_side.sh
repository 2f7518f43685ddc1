#!/usr/bin/env bash
# Measures the real Triton and shmserve one after the other in one run, on the same models
# (../shared/bench-models), with the same client (shmserve-perf), and leaves JSON per run in
# $OUT (--summary-json). Only one server runs at a time in these sections, so both see the same 2
# cores, though minutes apart (and this host's speed moves within minutes).
#
#   tools/side_by_side.sh [add_sub|identity|mlp|local|ready|paired ...]     (default: all)
#
# Each level is measured in windows of $DURATION seconds until three agree (at most $TRIALS).
# 'local' runs shmserve-perf -i local against the same shmserve (add_sub at concurrency 1 and 4,
# identity 16 MiB with its input in a client region), to compare with Triton's HTTP.
# 'paired' then starts both servers together and runs shmserve-perf --compare: the same client
# processes alternate between them in 2 s slices, A B B A (add_sub at 1 and 4 over HTTP and the
# local client, identity 16 MiB in the body and through shm regions, mlp at 8; then the gRPC
# endpoints, Triton's on 18001, ours on 18601 and grpcio alone (tools/grpc_floor.py) on 18701:
# add_sub at 1 and 4, identity 16 MiB; the HTTP rows beside uvicorn alone, tools/http_floor.py on
# 18703, and the 16 MiB rows beside one core's memcpy), which keeps the host's fast and slow phases out of the
# ratios. An idle server costs the other next to nothing.
# BASELINE=/path/to/another/checkout (with its own .venv) adds that shmserve to the paired runs as
# server 'before' (port 18700), to compare two versions of shmserve against Triton in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/side_by_side}
MODELS=${MODELS:-../shared/bench-models}
PERF=${PERF:-.venv/bin/shmserve-perf}
DURATION=${DURATION:-10}
TRIALS=${TRIALS:-10}
mkdir -p "$OUT"
what=${*:-add_sub identity mlp local ready paired}

wait_ready() { for _ in $(seq 600); do curl -sf "localhost:$1/v2/health/ready" >/dev/null && return 0; sleep 0.2; done; return 1; }
wait_port() { for _ in $(seq 600); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.2; done; return 1; }

# identity 16 MiB: the input's shape, and room for the output when it travels through shm regions
I="-m identity --shape INPUT0:4194304 --output-shared-memory-size 16777216"
W="-p $((DURATION * 1000)) -r $TRIALS --warmup 2000 -q"

run_bench() {  # name port metrics-port
  local name=$1 port=$2 B="$PERF -u 127.0.0.1:$2 $W"
  for w in $what; do
    case $w in
      add_sub)  $B -m add_sub --concurrency-range 1:4:3 --summary-json "$OUT/$name-add_sub.json" ;;
      identity) $B $I --summary-json "$OUT/$name-identity-http.json"
                $B $I --shared-memory system --summary-json "$OUT/$name-identity-shm.json" ;;
      mlp)      $PY -m shmserve.tools.batch_size --metrics "127.0.0.1:$3" --model mlp -- \
                  $B -m mlp --concurrency-range 8 --summary-json "$OUT/$name-mlp.json" | tee "$OUT/$name-mlp.txt" ;;
    esac
  done
}

if [[ " $what " =~ \ (add_sub|identity|mlp|local)\  ]]; then  # each server alone, one after the other
  echo "== Triton"
  setsid ../shared/tools/reference-triton "$MODELS" > "$OUT/triton.log" 2>&1 < /dev/null &
  wait_ready 18000
  run_bench triton 18000 18002
  kill -TERM -- -"$(pgrep -x tritonserver)" 2>/dev/null || true
  while pgrep -x tritonserver >/dev/null; do sleep 0.5; done

  echo "== shmserve"
  setsid .venv/bin/shmserve --model-repository="$MODELS" --http-port=18600 --metrics-port=18602 --grpc-port=18601 --id sbs \
    > "$OUT/shmserve.log" 2>&1 < /dev/null &
  pid=$!
  wait_ready 18600
  run_bench shmserve 18600 18602
  if [[ " $what " == *" local "* ]]; then
    L="$PERF -i local -u sbs $W"
    $L -m add_sub --concurrency-range 1:4:3 --summary-json "$OUT/shmserve-local-add_sub.json"
    $L $I --shared-memory system --summary-json "$OUT/shmserve-local-identity.json"
  fi
  kill -TERM "$pid"; wait "$pid" || true
fi

if [[ " $what " == *" ready "* ]]; then
  echo "== time to ready, 7 models"
  $PY -m shmserve.tools.time_to_ready --models 7 --url 127.0.0.1:18000 -- ../shared/tools/reference-triton {repo} | tee "$OUT/triton-ready.txt"
  $PY -m shmserve.tools.time_to_ready --models 7 --url 127.0.0.1:18600 -- \
    .venv/bin/shmserve --model-repository={repo} --http-port=18600 --metrics-port=18602 --grpc-port=18601 --id sbsready | tee "$OUT/shmserve-ready.txt"
fi

if [[ " $what " == *" paired "* ]]; then
  echo "== paired: both servers up, alternating slices"
  setsid ../shared/tools/reference-triton "$MODELS" > "$OUT/triton-paired.log" 2>&1 < /dev/null &
  # Each server's connections idle while the others take their slices: longer than the 5 s after
  # which shmserve closes an idle connection (a request sent as it closes would fail the run).
  setsid .venv/bin/shmserve --model-repository="$MODELS" --http-port=18600 --metrics-port=18602 --grpc-port=18601 --id sbs \
    --http-idle-timeout-secs=3600 > "$OUT/shmserve-paired.log" 2>&1 < /dev/null &
  pid=$!
  trap 'kill -TERM -- -"$(pgrep -x tritonserver)" 2>/dev/null; kill -TERM "$pid" ${before:-} 2>/dev/null; pkill -f "shmserve.tools.(http|grpc)_floor"' EXIT
  P="$PERF --pairs ${PAIRS:-10} -p 2000 -q -u 127.0.0.1:18000 --name triton --compare shmserve=127.0.0.1:18600"
  if [[ -n ${BASELINE:-} ]]; then
    # (from its own folder: an older layout starts its processes with `python -m server...`; the
    # script run by its own venv's python, not by its #! line: a venv copied from another checkout
    # keeps that checkout's interpreter there, and would serve the other checkout's code)
    models=$(realpath "$MODELS")
    (cd "$BASELINE" && exec setsid .venv/bin/python .venv/bin/shmserve --model-repository="$models" \
      --http-port=18700 --metrics-port=18702 --id sbsbefore > "$OUT/before-paired.log" 2>&1 < /dev/null) &
    before=$!
    wait_ready 18700
    P="$P --compare before=127.0.0.1:18700"
  fi
  wait_ready 18000
  wait_ready 18600
  # uvicorn alone (tools/http_floor.py: echo, nothing else): the part of our HTTP cost no code of ours sets.
  $PY -m shmserve.tools.http_floor --port 18703 &
  httpfloor=$!
  wait_ready 18703
  F="--compare uvicorn-floor=127.0.0.1:18703"
  $P -m add_sub --concurrency-range 1 --compare local=local:sbs $F --summary-json "$OUT/paired-add_sub-1.json"
  $P -m add_sub --concurrency-range 4 --compare local=local:sbs $F --summary-json "$OUT/paired-add_sub-4.json"
  $P $I $F --summary-json "$OUT/paired-identity-http.json"
  kill -TERM "$httpfloor"; wait "$httpfloor" || true
  # One core's memcpy of the 16 MiB tensor: the floor of every 16 MiB row (best of 20, ms).
  $PY -c 'import numpy as np, time; a = np.ones(1 << 24, np.uint8); b = np.empty_like(a); t = []
for _ in range(20): s = time.perf_counter(); np.copyto(b, a); t.append(time.perf_counter() - s)
print(f"memcpy of 16 MiB: {min(t) * 1e3:.2f} ms")' | tee "$OUT/memcpy.txt"
  $P $I --shared-memory system --compare local=local:sbs --summary-json "$OUT/paired-identity-shm.json"
  # Each server's average batch over its own slices (outer: Triton's metrics, inner: ours).
  $PY -m shmserve.tools.batch_size --metrics 127.0.0.1:18002 --model mlp -- $PY -m shmserve.tools.batch_size --metrics 127.0.0.1:18602 \
    --model mlp -- $P -m mlp --concurrency-range 8 --summary-json "$OUT/paired-mlp.json" | tee "$OUT/paired-mlp.txt"
  # Triton's GRPCInferenceService against ours, raw binary tensors.
  wait_port 18001
  wait_port 18601
  G="$PERF --pairs ${PAIRS:-10} -p 2000 -q -i grpc -u 127.0.0.1:18001 --name triton-grpc"
  G="$G --compare shmserve-grpc=grpc:127.0.0.1:18601 --compare grpcio-floor=grpc:127.0.0.1:18701"
  # grpcio alone (tools/grpc_floor.py: echo, nothing else): the part of our cost no code of ours sets.
  $PY -m shmserve.tools.grpc_floor --port 18701 &
  floor=$!
  wait_port 18701
  $G -m add_sub --concurrency-range 1 --summary-json "$OUT/paired-grpc-add_sub-1.json"
  $G -m add_sub --concurrency-range 4 --summary-json "$OUT/paired-grpc-add_sub-4.json"
  $G $I --summary-json "$OUT/paired-grpc-identity.json"
  kill -TERM "$floor"; wait "$floor" || true
  kill -TERM -- -"$(pgrep -x tritonserver)" 2>/dev/null || true
  kill -TERM "$pid"; wait "$pid" || true
  if [[ -n ${BASELINE:-} ]]; then kill -TERM "$before"; wait "$before" || true; fi
  while pgrep -x tritonserver >/dev/null; do sleep 0.5; done
fi
