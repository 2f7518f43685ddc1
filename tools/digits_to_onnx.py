"""Write ``model_repository/digits_onnx/1/model.onnx``: the digits CNN of
``model_repository/digits/1/model.pt`` as an ONNX graph with the same weights, so the two
models answer the same images alike (the ONNX Runtime backend's bundled example).

The graph is built node by node with the ``onnx`` package's helpers from the TorchScript file's
weights (Conv, Relu, Conv, Relu, MaxPool, Flatten, Gemm, as ``DigitsCNN`` in train_digits.py
computes), rather than by a torch exporter: the result depends only on those weights, so the
committed file is reproduced byte for byte, and no exporter package is needed. Before writing,
onnxruntime runs the graph on the held-out digits beside torch and the two must agree.

Usage (from the project root; needs torch, onnx and onnxruntime: ``pip install -e '.[test]'``)::

    python tools/digits_to_onnx.py
    python tools/digits_to_onnx.py --torchscript model.pt --output /tmp/model.onnx
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = PROJECT_ROOT / "model_repository" / "digits" / "1" / "model.pt"
DEFAULT_OUTPUT = PROJECT_ROOT / "model_repository" / "digits_onnx" / "1" / "model.onnx"
OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime since 1.10
TOLERANCE = 1e-4  # logits: the two runtimes sum in different orders


def build(weights: dict[str, np.ndarray]) -> bytes:
    """The serialized ONNX model: INPUT__0 FP32 [batch, 1, 8, 8] -> OUTPUT__0 FP32 [batch, 10]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    names = {"features.0.weight": "conv1_w", "features.0.bias": "conv1_b", "features.2.weight": "conv2_w",
             "features.2.bias": "conv2_b", "classifier.weight": "fc_w", "classifier.bias": "fc_b"}
    initializers = [numpy_helper.from_array(np.ascontiguousarray(weights[k], dtype=np.float32), v)
                    for k, v in names.items()]
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["INPUT__0", "conv1_w", "conv1_b"], ["c1"], **conv),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "conv2_w", "conv2_b"], ["c2"], **conv),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["OUTPUT__0"], transB=1),
    ]
    graph = helper.make_graph(nodes, "digits", [helper.make_tensor_value_info("INPUT__0", TensorProto.FLOAT,
                                                                              ["batch", 1, 8, 8])],
                              [helper.make_tensor_value_info("OUTPUT__0", TensorProto.FLOAT, ["batch", 10])],
                              initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="shmserve")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def held_out() -> np.ndarray:
    """The digits train_digits.py tests on, as float32 [n, 1, 8, 8] in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    _, x_test = train_test_split(images, test_size=0.2, random_state=0, stratify=digits.target)
    return x_test


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchscript", type=Path, default=DEFAULT_INPUT)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    import onnxruntime
    import torch

    module = torch.jit.load(str(args.torchscript), map_location="cpu").eval()
    data = build({k: v.numpy() for k, v in module.state_dict().items()})
    x = held_out()
    with torch.inference_mode():
        want = module(torch.from_numpy(x)).numpy()
    got = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"INPUT__0": x})[0]
    worst = float(np.abs(got - want).max())
    if worst > TOLERANCE or not np.array_equal(got.argmax(1), want.argmax(1)):
        raise SystemExit(f"the ONNX graph disagrees with {args.torchscript}: largest logit difference {worst:.2e}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(data)
    print(f"wrote {args.output} ({len(data)} bytes); {len(x)} held-out digits: same predictions as "
          f"{args.torchscript.name}, logits within {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
