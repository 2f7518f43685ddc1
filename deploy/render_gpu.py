"""Writes deploy/kubernetes/gpu/deployment.yaml: the CPU Deployment with the CUDA image, one GPU
per pod, and the toleration GPU node pools usually carry. One source for both keeps their probes,
volumes and flags alike (tests/test_deploy.py checks that the file is this script's output).

    python deploy/render_gpu.py            # rewrites the file
    python deploy/render_gpu.py --check    # exit 1 if the file is not what this script writes
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kubernetes" / "deployment.yaml"
TARGET = HERE / "kubernetes" / "gpu" / "deployment.yaml"
HEADER = ("# Written by deploy/render_gpu.py from ../deployment.yaml: edit that file and run the script.\n"
          "# The CUDA image (Dockerfile, --build-arg VARIANT=cuda) with one GPU per pod; apply it instead of\n"
          "# ../deployment.yaml (same name, so the Service, HPA and PodDisruptionBudget apply unchanged).\n")
GPUS_PER_POD = 1


def render(cpu: dict) -> dict:
    gpu = copy.deepcopy(cpu)
    pod = gpu["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["image"] = container["image"] + "-cuda"
    # An extended resource is requested by its limit (the request defaults to it, and may not differ).
    container["resources"]["limits"]["nvidia.com/gpu"] = GPUS_PER_POD
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return gpu


def text() -> str:
    return HEADER + yaml.safe_dump(render(yaml.safe_load(SOURCE.read_text())), sort_keys=False)


def main(argv: list[str]) -> int:
    out = text()
    if "--check" in argv:
        if TARGET.read_text() != out:
            sys.stderr.write(f"{TARGET} is not what deploy/render_gpu.py writes: run it\n")
            return 1
        return 0
    TARGET.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
