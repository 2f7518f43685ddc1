"""Average batch size of a model between two reads of a server's Prometheus metrics (Triton's
and ours name them alike): ``nv_inference_count / nv_inference_exec_count`` over the interval.

    python -m shmserve.tools.batch_size --metrics 127.0.0.1:8002 --model mlp -- <command to run meanwhile>
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import urllib.request


def counts(metrics: str, model: str) -> tuple[float, float]:
    """(inferences, executions) summed over the model's versions."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    inferences = executions = 0.0
    for line in text.splitlines():
        if f'model="{model}"' not in line:
            continue
        if line.startswith("nv_inference_count{"):
            inferences += float(line.rsplit(" ", 1)[1])
        elif line.startswith("nv_inference_exec_count{"):
            executions += float(line.rsplit(" ", 1)[1])
    return inferences, executions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, help="host:port of the metrics endpoint")
    p.add_argument("--model", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run while counting")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    before = counts(args.metrics, args.model)
    code = subprocess.call(command) if command else 0
    after = counts(args.metrics, args.model)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    average = inferences / executions if executions else 0.0
    print(f"{args.model}: {int(inferences)} inferences in {int(executions)} executions, "
          f"average batch size {average:.2f}")
    return code


if __name__ == "__main__":
    sys.exit(main())
