"""PyTorch models (``platform: "pytorch_libtorch"`` or ``backend: "pytorch"``): TorchScript
``model.pt``, or a ``torch.export`` program ``model.pt2``.

Inputs and outputs bind as Triton's PyTorch backend binds them (pytorch_binding.py). An optional
input a request leaves out is not passed when no later input is (forward()'s default applies),
and is passed as None before one that is. A ``TYPE_STRING`` input of a model that does not batch
is a ``List[str]``, and a ``List[str]`` the model returns a BYTES output. An output whose
datatype is not the config's fails the batch in Triton's words. A batch of several requests runs
as one forward over the concatenated batch dimension, then is split per request.
Ragged inputs, batch inputs and batch outputs are Triton's (batch_io.py): a ragged input is one
flat tensor of the batch's elements, and the batch inputs come after the config's inputs (or
where their ``__<index>`` or forward() argument name puts them).

A GPU instance makes its GPU the worker's current device (a bare ``.cuda()`` lands there), takes
inputs that lie in a client's CUDA region as they are, and hands back on the device the outputs
a client placed in a CUDA region (copied device to device into it); other outputs come to the
host in one copy.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from shmserve.shm import heap

from . import device_tensors, pytorch_runtime, shared_weights
from .backend import Backend, Instance, InstanceContext, Model, ModelContext, ModelLoadError, Request, Response
from .batch_io import BatchIO
from .pytorch_binding import InputBinding, bind_inputs, check_datatypes, forward_arguments, output_indices
from .pytorch_settings import TorchSettings
from .requests import RequestError

log = logging.getLogger("shmserve.worker")
# torch's dtypes by their name, as the wire's datatypes (an output checked against its config)
_WIRE_OF_TORCH = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "float64": "FP64", "int8": "INT8",
                  "int16": "INT16", "int32": "INT32", "int64": "INT64", "uint8": "UINT8", "uint16": "UINT16",
                  "uint32": "UINT32", "uint64": "UINT64", "bool": "BOOL"}


class PyTorchBackend(Backend):
    def __init__(self) -> None:
        import torch  # imported in the worker only: the broker never pays for torch

        self.torch = torch

    def auto_complete_config(self, ctx: ModelContext) -> dict[str, Any]:
        """Nothing to complete from a TorchScript file (it keeps no tensor names): Triton's warning."""
        log.warning("skipping model configuration auto-complete for '%s': not supported for pytorch backend", ctx.name)
        return ctx.config

    def create_model(self, ctx: ModelContext) -> Model:
        return PyTorchModel(self.torch, ctx)


class PyTorchModel(Model):
    def __init__(self, torch: Any, ctx: ModelContext) -> None:
        self.torch = torch
        self.ctx = ctx

    def create_instance(self, ictx: InstanceContext) -> Instance:
        torch = self.torch
        runtime = self.ctx.config.get("runtime") or ""
        python_runtime = pytorch_runtime.uses_python_runtime(self.ctx.config)
        if runtime and not python_runtime and not runtime.endswith(".so"):
            raise ModelLoadError(f"model '{self.ctx.name}': runtime '{runtime}' is not one of the pytorch backend's: "
                                 f"'model.py' (the PyTorch 2 runtime) or the default TorchScript runtime")
        if python_runtime:  # (Triton's PyTorch 2 runtime reads none of the TorchScript runtime's parameters)
            settings = TorchSettings()
            pytorch_runtime.set_threads(torch, self.ctx.config, ictx.name)
        else:
            settings = TorchSettings.from_config(self.ctx.config)  # (a bad value fails the load, named)
            settings.apply(torch, ictx.name)
            pytorch_runtime.warn_python_only(self.ctx.config, ictx.name)
        if ictx.kind == "GPU" and not torch.cuda.is_available():
            # The driver shows a GPU but this torch cannot use it (a CPU build, say): running the
            # instance on the CPU instead would hide that from whoever asked for KIND_GPU.
            raise RuntimeError(f"model '{self.ctx.name}': instance '{ictx.name}' is KIND_GPU but CUDA is not "
                               f"available to torch {torch.__version__}")
        device = torch.device(f"cuda:{ictx.device_id}" if ictx.kind == "GPU" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if python_runtime:
            path = pytorch_runtime.model_file(self.ctx.version_dir, self.ctx.config)
            with torch.inference_mode():
                module = pytorch_runtime.load(torch, path, self.ctx.name, self.ctx.config, device)
            return PyTorchInstance(torch, module, device, self.ctx.config, settings, self.ctx.name, config_order=True)
        filename = self.ctx.config.get("default_model_filename") or ""
        if not filename:
            exported = self.ctx.version_dir / "model.pt2"
            filename = "model.pt2" if exported.exists() and not (self.ctx.version_dir / "model.pt").exists() \
                else "model.pt"
        path = self.ctx.version_dir / filename
        if filename.endswith(".pt2"):
            # A torch.export program: its module() is a plain callable with the traced signature.
            module = torch.export.load(str(path)).module().to(device)
        else:
            module = torch.jit.load(str(path), map_location=device)
            module.eval()
        if device.type == "cpu":
            self._share_weights(module, ictx)
        return PyTorchInstance(torch, module, device, self.ctx.config, settings, self.ctx.name)

    def _share_weights(self, module: Any, ictx: InstanceContext) -> None:
        """One copy of the weights for every CPU instance of this load (shared_weights.py),
        unless the parameter ``SHARE_WEIGHTS`` says "no"; where /dev/shm has no room for it the
        instance keeps its own copy, and says so."""
        setting = (self.ctx.config.get("parameters", {}).get("SHARE_WEIGHTS") or {}).get("string_value", "yes")
        if setting.strip().lower() in ("no", "false", "off", "0") or not self.ctx.weights_key:
            return
        try:
            shared = shared_weights.share(module, self.ctx.server_id, self.ctx.weights_key)
        except OSError as e:
            log.warning("model '%s' instance '%s' keeps its own copy of the weights: %s", self.ctx.name,
                        ictx.name, e)
            return
        heap.give_back_free_memory()  # the private copy just dropped
        log.info("model '%s' instance '%s': %s of weights in one shared copy", self.ctx.name, ictx.name,
                 f"{shared / 1e6:.1f} MB" if shared >= 100_000 else f"{shared / 1e3:.1f} kB")


class PyTorchInstance(Instance):
    def __init__(self, torch: Any, module: Any, device: Any, config: dict,
                 settings: TorchSettings = TorchSettings(), model: str = "", config_order: bool = False) -> None:
        self.torch = torch
        self.module = module
        self.device = device
        self.settings = settings
        self.device_inputs = device.type == "cuda"
        self.batched = config.get("max_batch_size", 0) > 0
        self.batch_io = BatchIO(config)
        if config_order:  # the PyTorch 2 runtime: the config's inputs and outputs in order (pytorch_runtime.py)
            self.binding = InputBinding(tuple(t["name"] for t in config.get("input", [])))
            self.outputs = {t["name"]: i for i, t in enumerate(config.get("output", []))}
        else:
            self.binding = bind_inputs(model, config, self.batch_io.targets, forward_arguments(module))
            self.outputs = output_indices(config)
        states = (config.get("sequence_batching") or {}).get("state", [])
        self.output_types = {t["name"]: t.get("data_type", "")[len("TYPE_"):] for t in config.get("output", [])}
        self.output_types.update({s["output_name"]: s.get("data_type", "")[len("TYPE_"):] for s in states
                                  if s.get("output_name")})
        if not config_order:  # (Triton's PyTorch 2 runtime does not check them)
            check_datatypes(model, config)
        for t in config.get("input", []):
            dims = t.get("reshape", {}).get("shape", t.get("dims", [])) if "reshape" in t else t.get("dims", [])
            if t.get("data_type") == "TYPE_STRING" and len(dims) + self.batched > 1:
                raise ModelLoadError(f"Triton only supports 1 dimensional List of String as input for "
                                     f"'{t['name']}' for model '{model}'")

    def execute(self, requests: list[Request]) -> list[Response]:
        torch = self.torch
        sizes = [next(iter(r.inputs.values())).shape[0] if self.batched and r.inputs else 1 for r in requests]
        io = self.batch_io
        inputs = [r.inputs for r in requests]
        generated = io.batch_inputs(inputs)

        def value(name: str | None) -> Any:
            if name is None:
                return None
            if name in generated:
                return torch.from_numpy(generated[name]).to(self.device)
            if name not in requests[0].inputs:  # an optional input left out (a batch shares its inputs' names)
                return None
            return self._input(io.parts(name, [i[name] for i in inputs]))

        slots = self.binding.slots
        if self.binding.as_dict:
            tensors: list[Any] = [{n: v for n in slots if n is not None and (v := value(n)) is not None}]
        else:
            tensors = [value(n) for n in slots]
            while tensors and tensors[-1] is None:
                tensors.pop()  # trailing absent inputs are not passed, so forward()'s defaults apply
        with self.settings.running(torch):
            result = self.module(*tensors)
        outputs, refusal = self._outputs(result)
        if refusal is not None:  # as Triton's backend: every request of the batch gets it
            return [Response(error=refusal, status=400) for _ in requests]
        on_device = frozenset().union(*(r.device_outputs for r in requests)) if self.device_inputs else ()
        host = {k: v if isinstance(v, np.ndarray) else v.detach() if k in on_device else device_tensors.host_array(v)
                for k, v in outputs.items()}
        if self.settings.cache_cleaning and self.device.type == "cuda":
            torch.cuda.empty_cache()  # ENABLE_CACHE_CLEANING, as Triton's backend after each execution
        scattered = {k: io.scatter(k, v, inputs) for k, v in host.items() if k in io.outputs}
        if len(requests) == 1 and not scattered:
            return [Response(outputs=host)]
        responses, start = [], 0
        for j, n in enumerate(sizes):
            responses.append(Response(outputs={k: scattered[k][j] if k in scattered else
                                               v if len(requests) == 1 else v[start:start + n]
                                               for k, v in host.items()}))
            start += n
        return responses

    def _outputs(self, result: Any) -> tuple[dict[str, Any], str | None]:
        """The config's outputs out of what forward() returned (a tensor, a tuple or list of them,
        a ``List[str]``, or a dict by name), and Triton's refusal when one is not there or not of
        its configured datatype."""
        torch = self.torch
        if isinstance(result, dict):
            outputs = dict(result)
        else:
            if isinstance(result, torch.Tensor) or (isinstance(result, list) and result and
                                                    all(isinstance(x, str) for x in result)):
                result = (result,)
            for name, index in self.outputs.items():
                if index >= len(result):
                    return {}, (f"The output {name} in the model configuration refers to an output index which "
                                f"doesn't exist. This model has {len(result)} outputs")
            outputs = {name: result[index] for name, index in self.outputs.items()}
        for name, v in list(outputs.items()):
            if isinstance(v, list) and all(isinstance(x, str) for x in v):
                outputs[name] = np.array([x.encode() for x in v], dtype=object)  # List[str]: BYTES
                continue
            expected = self.output_types.get(name)
            got = _WIRE_OF_TORCH.get(str(v.dtype).removeprefix("torch.")) if isinstance(v, torch.Tensor) else None
            if expected and got and expected != got:
                return {}, (f"configuration expects datatype TYPE_{expected} for output '{name}', model provides "
                            f"TYPE_{got}")
        return outputs, None

    def failure(self, name: str, e: BaseException) -> str:
        """Triton's PyTorch backend's words for a forward() that raised."""
        return f"PyTorch execute failure: {e}"

    def _input(self, parts: list[Any]) -> Any:
        """One input of the batch as a tensor on the instance's device: host arrays concatenated
        and copied once; device tensors (a client's CUDA region) used as they are when alone. A
        BYTES input (``TYPE_STRING``, which Triton takes only where the model does not batch) is
        the ``List[str]`` TorchScript takes."""
        torch = self.torch
        if len(parts) == 1 and isinstance(parts[0], np.ndarray) and parts[0].dtype == object:
            try:
                return [x.decode() if isinstance(x, bytes) else str(x) for x in parts[0].reshape(-1)]
            except UnicodeDecodeError:
                raise RequestError("a TYPE_STRING input of a PyTorch model must be UTF-8 text") from None
        if not any(device_tensors.is_tensor(p) for p in parts):
            arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if not arr.flags.writeable:
                arr = arr.copy()
            return torch.from_numpy(arr).to(self.device)
        tensors = [(p if device_tensors.is_tensor(p) else torch.from_numpy(np.array(p))).to(self.device)
                   for p in parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
