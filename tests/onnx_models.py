"""Small ONNX graphs the ONNX Runtime backend tests serve, built with the onnx package's helpers at
test time (no exporter, no files in the repository): each function writes one model folder."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # what every onnxruntime since 1.10 reads

# Triton datatype -> ONNX element type, for the identity model of every datatype.
ELEMENT_TYPES = {
    "BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8, "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32, "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16, "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
    "BF16": TensorProto.BFLOAT16, "BYTES": TensorProto.STRING,
}


def tensor(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def model(nodes: list, inputs: list, outputs: list, initializers: list | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=initializers or [])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = IR_VERSION
    onnx.checker.check_model(m)
    return m


def write(repo: Path, name: str, m: onnx.ModelProto, config: str | None, filename: str = "model.onnx") -> Path:
    """``repo/name/1/<filename>`` and, unless None, ``repo/name/config.pbtxt``."""
    version = repo / name / "1"
    version.mkdir(parents=True)
    onnx.save_model(m, str(version / filename))
    if config is not None:
        (repo / name / "config.pbtxt").write_text(config)
    return version


def add_sub(batch: object = "batch") -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 over FP32 [batch, 4] (Triton's add_sub)."""
    shape = [batch, 4]
    return model([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                  helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
                 [tensor("INPUT0", TensorProto.FLOAT, shape), tensor("INPUT1", TensorProto.FLOAT, shape)],
                 [tensor("OUTPUT0", TensorProto.FLOAT, shape), tensor("OUTPUT1", TensorProto.FLOAT, shape)])


def identity_all(datatypes: list[str]) -> onnx.ModelProto:
    """OUT_<dt> = IN_<dt> for every datatype, each [batch, -1]."""
    nodes, ins, outs = [], [], []
    for dt in datatypes:
        nodes.append(helper.make_node("Identity", [f"IN_{dt}"], [f"OUT_{dt}"]))
        ins.append(tensor(f"IN_{dt}", ELEMENT_TYPES[dt], ["batch", "n"]))
        outs.append(tensor(f"OUT_{dt}", ELEMENT_TYPES[dt], ["batch", "n"]))
    return model(nodes, ins, outs)


def per_row_scalar() -> onnx.ModelProto:
    """Y = X * 2 over FP32 [batch]: one scalar per row, which Triton declares dims [1] with an
    empty reshape."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    return model([helper.make_node("Mul", ["X", "two"], ["Y"])],
                 [tensor("X", TensorProto.FLOAT, ["batch"])], [tensor("Y", TensorProto.FLOAT, ["batch"])], [two])


def ragged_io() -> onnx.ModelProto:
    """Triton's ragged test model: OUTPUT0 = INPUT0, a ragged input that arrives as one flat [-1]
    tensor of a batch's elements (scattered back as a batch output), and N = COUNTS, the
    BATCH_ELEMENT_COUNT batch input [requests], as a column [requests, 1] split back by rows."""
    column = numpy_helper.from_array(np.array([1], np.int64), "column")
    return model([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"]),
                  helper.make_node("Unsqueeze", ["COUNTS", "column"], ["N"])],
                 [tensor("INPUT0", TensorProto.FLOAT, ["elements"]), tensor("COUNTS", TensorProto.INT32, ["requests"])],
                 [tensor("OUTPUT0", TensorProto.FLOAT, ["elements"]), tensor("N", TensorProto.INT32, ["requests", 1])],
                 [column])


def accumulator() -> onnx.ModelProto:
    """A sequence model with implicit state: SUM = STATE_IN * (1 - START) + VALUE, and the state
    it leaves is SUM; all FP32 [batch, 1]."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    shape = ["batch", 1]
    return model([helper.make_node("Sub", ["one", "START"], ["keep"]),
                  helper.make_node("Mul", ["STATE_IN", "keep"], ["kept"]),
                  helper.make_node("Add", ["kept", "VALUE"], ["SUM"]),
                  helper.make_node("Identity", ["SUM"], ["STATE_OUT"])],
                 [tensor("VALUE", TensorProto.FLOAT, shape), tensor("START", TensorProto.FLOAT, shape),
                  tensor("STATE_IN", TensorProto.FLOAT, shape)],
                 [tensor("SUM", TensorProto.FLOAT, shape), tensor("STATE_OUT", TensorProto.FLOAT, shape)], [one])


def row_sum() -> onnx.ModelProto:
    """A sequence model whose requests vary in length: SUM = the sum of VALUE's row, VALUE FP32
    [batch, length]; START (FP32 [batch, 1], its control) is fed and unused."""
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    return model([helper.make_node("ReduceSum", ["VALUE", "axes"], ["SUM"], keepdims=1)],
                 [tensor("VALUE", TensorProto.FLOAT, ["batch", "length"]),
                  tensor("START", TensorProto.FLOAT, ["batch", 1])],
                 [tensor("SUM", TensorProto.FLOAT, ["batch", 1])], [axes])


def mlp(features: int, hidden: int, classes: int, seed: int = 0) -> onnx.ModelProto:
    """Y = relu(X @ W1 + B1) @ W2 + B2 over FP32 [batch, features], with fixed random weights: a
    model whose answer on one device can be checked against onnxruntime's on another."""
    rng = np.random.default_rng(seed)
    weights = {"W1": rng.standard_normal((features, hidden)), "B1": rng.standard_normal(hidden),
               "W2": rng.standard_normal((hidden, classes)), "B2": rng.standard_normal(classes)}
    return model([helper.make_node("MatMul", ["X", "W1"], ["H0"]), helper.make_node("Add", ["H0", "B1"], ["H1"]),
                  helper.make_node("Relu", ["H1"], ["H"]), helper.make_node("MatMul", ["H", "W2"], ["Y0"]),
                  helper.make_node("Add", ["Y0", "B2"], ["Y"])],
                 [tensor("X", TensorProto.FLOAT, ["batch", features])],
                 [tensor("Y", TensorProto.FLOAT, ["batch", classes])],
                 [numpy_helper.from_array(w.astype(np.float32), name) for name, w in weights.items()])


def matmul_external(repo: Path, name: str, weights: np.ndarray, config: str) -> None:
    """Y = X @ W with W stored as external data: the version folder holds a directory
    ``model.onnx`` with ``model.onnx`` and ``weights.bin`` inside, as Triton takes such models."""
    m = model([helper.make_node("MatMul", ["X", "W"], ["Y"])],
              [tensor("X", TensorProto.FLOAT, ["batch", weights.shape[0]])],
              [tensor("Y", TensorProto.FLOAT, ["batch", weights.shape[1]])],
              [numpy_helper.from_array(weights, "W")])
    folder = repo / name / "1" / "model.onnx"
    folder.mkdir(parents=True)
    onnx.save_model(m, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    (repo / name / "config.pbtxt").write_text(config)


def zeros_of_shape() -> onnx.ModelProto:
    """OUT = zeros of the shape SHAPE (INT64 [1]) names: a negative size fails in onnxruntime's run."""
    return model([helper.make_node("ConstantOfShape", ["SHAPE"], ["OUT"])],
                 [tensor("SHAPE", TensorProto.INT64, [1])], [tensor("OUT", TensorProto.FLOAT, ["n"])])
