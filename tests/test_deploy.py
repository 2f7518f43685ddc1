"""The Kubernetes and KServe manifests in deploy/: valid against their schemas, and in agreement
with the server's flags and with each other.

Core kinds are validated with kubernetes-validate's strict schemas (unknown fields are errors);
PodMonitor and PrometheusRule with the models generated from the Prometheus Operator's CRDs
(cloudcoil-models-prometheus-operator), dumped back to catch fields the CRD does not know. No PyPI
package carries KServe's CRD schemas, so its resources are checked for the fields its CRDs require
and allow, with their containers and volumes validated as core Containers and Volumes.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

from conftest import PRODUCT_MODELS, ROOT

from shmserve.shm.access import parse_users
from shmserve.server import cache_flags, triton_flags
from shmserve.server.cli import build_parser
from shmserve.server.shm_needs import instance_bytes, startup_bytes
from shmserve.shm import space

DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
KSERVE = DEPLOY / "kserve"
# The oldest Kubernetes the manifests are written for (preStop's sleep action is beta from 1.30) and
# the newest kubernetes-validate knows.
KUBE_VERSIONS = ("1.30", kv_utils.latest_version())
# KServe's model agent calls the runtime at localhost:8080 (pkg/agent/puller.go), and its storage
# initializer puts the model at /mnt/models (constants.DefaultModelLocalMountPath).
KSERVE_HTTP_PORT = 8080
KSERVE_MODEL_DIR = "/mnt/models"
PREFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> dict[str, dict]:
    """Every resource in deploy/, by '<file>:<kind>'."""
    out = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in docs(path):
            out[f"{path.relative_to(DEPLOY)}:{doc['kind']}"] = doc
    return out


def by_kind(kind: str, folder: Path = KUBE) -> dict:
    found = [d for p in sorted(folder.glob("*.yaml")) for d in docs(p) if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {folder}, found {len(found)}"
    return found[0]


def quantity(text: str | int) -> int:
    """A Kubernetes quantity ('2Gi', '512Mi', '1G') in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMG])?", str(text))
    assert m, f"not a quantity: {text!r}"
    return int(m.group(1)) * PREFIXES.get(m.group(2) or "", 1)


def server_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` as the server reads it (the repository need not exist here)."""
    args = build_parser().parse_args(argv)
    args.response_cache_bytes, _ = cache_flags.response_cache(args)
    args.worker_arena_start_bytes, args.worker_arena_growth_bytes = triton_flags.worker_arena_sizes(args)
    return args


def flag_value(argv: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {argv}"
    return values[0]


def core_validator(definition: str) -> jsonschema.Draft202012Validator:
    """kubernetes-validate's strict schema of one core type (Container, Volume) on its own."""
    folder = f"kubernetes-json-schema/v{kv_utils.latest_version()}-local-strict"
    schema = kv_utils.schema_contents(f"{folder}/{definition}-v1.json", kv_utils.latest_version())
    defs = kv_utils.schema_contents(f"{folder}/_definitions.json", kv_utils.latest_version())
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def volume_of(pod: dict, container: dict, mount_path: str) -> dict:
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == mount_path]
    assert len(mounts) == 1, f"nothing mounted at {mount_path}"
    return next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])


def shm_need(argv: list[str], instances: int) -> int:
    args = server_args(argv)
    return startup_bytes(args) + instances * instance_bytes(args.worker_arena_start_bytes)


# -- schemas ------------------------------------------------------------------------------------


CORE = [name for name, d in manifests().items() if not d["apiVersion"].startswith(("monitoring.coreos.com",
                                                                                    "serving.kserve.io"))]


@pytest.mark.parametrize("name", CORE)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_core_manifests_validate_against_the_kubernetes_schemas(name, version):
    kubernetes_validate.validate(manifests()[name], version, strict=True)


def test_every_core_kind_is_covered():
    kinds = {name.split(":")[1] for name in CORE}
    assert kinds == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"}


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_prometheus_operator_resources_match_their_crds(kind):
    from cloudcoil.models.prometheus_operator import v1

    doc = by_kind(kind)
    model = getattr(v1, kind).model_validate(doc)
    # The models ignore fields they do not know: what comes back without them is what the CRD has.
    assert model.model_dump(by_alias=True, exclude_unset=True) == doc


def test_kserve_resources_have_what_their_crds_require():
    runtime = by_kind("ClusterServingRuntime", KSERVE)
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    spec = runtime["spec"]
    allowed = {"affinity", "annotations", "builtInAdapter", "containers", "disabled", "grpcDataEndpoint",
               "grpcEndpoint", "hostIPC", "httpDataEndpoint", "imagePullSecrets", "labels", "multiModel",
               "nodeSelector", "protocolVersions", "replicas", "schedulerName", "storageHelper",
               "supportedModelFormats", "tolerations", "volumes", "workerSpec"}
    assert set(spec) <= allowed and "containers" in spec
    assert set(spec["protocolVersions"]) <= {"v1", "v2", "grpc-v1", "grpc-v2"}
    for fmt in spec["supportedModelFormats"]:
        assert "name" in fmt and set(fmt) <= {"name", "version", "autoSelect", "priority"}, fmt
    containers, volumes = core_validator("container"), core_validator("volume")
    for c in spec["containers"]:
        containers.validate(c)
    for v in spec["volumes"]:
        volumes.validate(v)

    isvc = by_kind("InferenceService", KSERVE)
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    model = dict(isvc["spec"]["predictor"]["model"])
    assert set(model["modelFormat"]) <= {"name", "version"} and "name" in model["modelFormat"]
    kserve_fields = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage"}
    # The rest of a model's fields are a core Container's (its name is given by KServe).
    containers.validate({"name": "kserve-container", **{k: v for k, v in model.items() if k not in kserve_fields}})


def test_the_gpu_deployment_is_the_rendered_cpu_one():
    done = subprocess.run([sys.executable, str(DEPLOY / "render_gpu.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    gpu = yaml.safe_load((KUBE / "gpu" / "deployment.yaml").read_text())
    container = pod_spec(gpu)["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert container["image"].endswith("-cuda")


# -- agreement with the server's flags ----------------------------------------------------------


@pytest.mark.parametrize("path", [KUBE / "deployment.yaml", KUBE / "gpu" / "deployment.yaml"])
def test_the_deployment_agrees_with_the_server_flags(path):
    deployment = yaml.safe_load(path.read_text())
    pod = pod_spec(deployment)
    (c,) = pod["containers"]
    args = server_args(c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    for probe, path_ in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                         ("livenessProbe", "/v2/health/live")):
        assert c[probe]["httpGet"] == {"path": path_, "port": "http"}, probe
    assert volume_of(pod, c, args.model_repository[0]), "the model repository is not mounted where --model-repository says"
    # SIGTERM comes after preStop; the drain then takes up to --exit-timeout-secs, and stopping the
    # workers and removing the shared memory a few seconds more.
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + args.exit_timeout_secs + 10
    dshm = volume_of(pod, c, "/dev/shm")["emptyDir"]
    assert dshm["medium"] == "Memory"
    instances = int(deployment["spec"]["template"]["metadata"]["annotations"]["shmserve/instances-per-pod"])
    assert quantity(dshm["sizeLimit"]) >= shm_need(c["args"], instances)
    # tmpfs pages are charged to the container: its memory limit must hold a full /dev/shm and more.
    assert quantity(c["resources"]["limits"]["memory"]) > quantity(dshm["sizeLimit"])
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["runAsNonRoot"]


def test_the_pod_with_the_application_shares_only_dev_shm_under_a_named_user():
    """deploy/kubernetes/pod-local-client/: the application's container reaches the server through
    one memory-backed emptyDir at /dev/shm, as a user of its own that the server's
    --local-client-users names, and shares nothing else."""
    deployment = yaml.safe_load((KUBE / "pod-local-client" / "deployment.yaml").read_text())
    pod = pod_spec(deployment)
    server, app = pod["containers"]
    args = server_args(server["args"])
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    assert volume_of(pod, server, args.model_repository[0])
    dshm = volume_of(pod, server, "/dev/shm")
    assert volume_of(pod, app, "/dev/shm") is dshm and dshm["emptyDir"]["medium"] == "Memory"
    assert [m["mountPath"] for m in app["volumeMounts"]] == ["/dev/shm"]
    assert not any(pod.get(k) for k in ("shareProcessNamespace", "hostIPC", "hostPID"))
    uid = pod["securityContext"]["runAsUser"]
    assert server.get("securityContext", {}).get("runAsUser", uid) == uid
    app_uid = app.get("securityContext", {}).get("runAsUser", uid)
    assert app_uid != uid and parse_users(args.local_client_users) == [app_uid]
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    need = shm_need(server["args"], int(notes["shmserve/instances-per-pod"])) \
        + quantity(notes["shmserve/local-clients-bytes"])
    assert quantity(dshm["emptyDir"]["sizeLimit"]) >= need
    # The example application is this repository's, where the image copies it.
    script = app["command"][1]
    assert script.startswith("/opt/shmserve/src/") and (ROOT / script.removeprefix("/opt/shmserve/src/")).is_file()


def test_the_service_monitoring_and_autoscaling_agree_with_the_deployment():
    deployment = by_kind("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (c,) = pod_spec(deployment)["containers"]
    port_names = {p["name"] for p in c["ports"]}

    service = by_kind("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert {p["targetPort"] for p in by_name.values()} == port_names
    assert by_name["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert {n: p["port"] for n, p in by_name.items()} == {p["name"]: p["containerPort"] for p in c["ports"]}

    monitor = by_kind("PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]

    (rule,) = by_kind("PrometheusRule")["spec"]["groups"][0]["rules"]
    assert f'container="{c["name"]}"' in rule["expr"]
    adapter = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])
    (exposed,) = adapter["rules"]
    assert exposed["seriesQuery"].split("{")[0].strip("'") == rule["record"]
    assert re.fullmatch(exposed["name"]["matches"], rule["record"])
    assert exposed["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert all(m in exposed["metricsQuery"] for m in ("<<.Series>>", "<<.LabelMatchers>>"))

    hpa = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == exposed["name"]["as"]

    pdb = by_kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"], "an eviction would empty the Deployment"


def test_the_kserve_runtime_agrees_with_kserve_and_the_server_flags():
    runtime = by_kind("ClusterServingRuntime", KSERVE)
    spec = runtime["spec"]
    assert {f["name"] for f in spec["supportedModelFormats"]} == {"python", "pytorch", "onnx", "triton"}
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container"
    args = server_args(c["args"])
    assert args.http_port == KSERVE_HTTP_PORT and args.model_repository == [KSERVE_MODEL_DIR]
    assert args.model_control_mode == "explicit" and args.load_model == ["*"]  # the agent loads and unloads
    assert spec["annotations"]["prometheus.kserve.io/port"] == str(args.metrics_port)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    dshm = next(v for v in spec["volumes"] if v["name"] == mount["name"])["emptyDir"]
    assert dshm["medium"] == "Memory" and quantity(dshm["sizeLimit"]) >= shm_need(c["args"], 4)
    assert quantity(c["resources"]["limits"]["memory"]) > quantity(dshm["sizeLimit"])

    isvc = by_kind("InferenceService", KSERVE)
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] in [{k: f[k] for k in ("name", "version") if k in f}
                                    for f in spec["supportedModelFormats"]]


def test_the_dockerfile_agrees_with_the_makefile_and_the_flags():
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1)
    assert re.search(rf"^TORCH_VERSION \?= {re.escape(torch)}$", makefile, re.M)
    defaults = build_parser().parse_args(["--model-repository=x"])
    exposed = re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()
    assert exposed == [str(defaults.http_port), str(defaults.grpc_port), str(defaults.metrics_port)]
    assert re.search(r'^CMD \["--model-repository=/models"\]$', dockerfile, re.M)
    assert f"127.0.0.1:{defaults.http_port}/v2/health/ready" in dockerfile
    assert re.search(r"^USER 1000:1000$", dockerfile, re.M)


def test_the_metrics_the_autoscaler_reads_are_served(server_factory, tmp_path):
    """The recording rule's series exist, per model, on the metrics port of a real server given the
    Deployment's --metrics-config."""
    repo = tmp_path / "repo"
    shutil.copytree(PRODUCT_MODELS / "add_sub", repo / "add_sub")
    (c,) = pod_spec(by_kind("Deployment"))["containers"]
    s = server_factory.start([repo], [a for a in c["args"] if a.startswith("--metrics-config")])
    a = np.arange(16, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    with s.client() as client:
        client.infer("add_sub", inputs)
    with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    (rule,) = by_kind("PrometheusRule")["spec"]["groups"][0]["rules"]
    used = set(re.findall(r"\b((?:nv|shmserve)_[a-z_]+)\{", rule["expr"]))
    assert used == {"shmserve_inference_queue_histogram_ms_bucket",
                    "shmserve_inference_compute_infer_histogram_ms_bucket", "nv_inference_pending_request_count"}
    for name in used:
        assert re.search(rf'^{name}\{{[^}}]*model="add_sub"[^}}]*\}} \d', text, re.M), f"{name} not served"


def test_the_docs_dev_shm_figures_are_the_servers():
    """README.md and docs/deploy.md quote the start's size with one HTTP frontend (the default
    follows the host's cores), and the per-instance size."""
    args = server_args(["--model-repository=/models", "--http-workers=1"])
    start, each = space.mib(startup_bytes(args)), space.mib(instance_bytes(args.worker_arena_start_bytes))
    for doc in (ROOT / "README.md", ROOT / "docs" / "deploy.md"):
        text = " ".join(doc.read_text().split())  # figures may wrap
        assert f"{start} at start" in text and f"{each} per model instance" in text, doc
