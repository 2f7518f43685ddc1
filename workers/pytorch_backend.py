"""PyTorch models (``platform: "pytorch_libtorch"`` or ``backend: "pytorch"``): TorchScript
``model.pt``, or a ``torch.export`` program ``model.pt2``.

Inputs bind as Triton's PyTorch backend binds them: names ``<name>__<index>`` give the position,
otherwise the config's order, or the forward() argument names when they match. An optional
input a request leaves out is not passed when no later input is (forward()'s default applies),
and is passed as None before one that is. Outputs
``<name>__<index>`` index the returned tuple; otherwise the config's order. A batch of several
requests runs as one forward over the concatenated batch dimension, then is split per request.
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
import re
from typing import Any

import numpy as np

from shmserve.shm import heap

from . import device_tensors, shared_weights
from .backend import Backend, Instance, InstanceContext, Model, ModelContext, Request, Response
from .batch_io import BatchIO
from .pytorch_settings import TorchSettings

_INDEXED = re.compile(r"^.+__(\d+)$")
log = logging.getLogger("shmserve.worker")


def _order(names: list[str]) -> list[str]:
    """Names with __<index> suffixes sorted by index; otherwise left in config order."""
    if names and all(_INDEXED.match(n) for n in names):
        return sorted(names, key=lambda n: int(_INDEXED.match(n).group(1)))  # type: ignore[union-attr]
    return names


class PyTorchBackend(Backend):
    def __init__(self) -> None:
        import torch  # imported in the worker only: the broker never pays for torch

        self.torch = torch

    def create_model(self, ctx: ModelContext) -> Model:
        return PyTorchModel(self.torch, ctx)


class PyTorchModel(Model):
    def __init__(self, torch: Any, ctx: ModelContext) -> None:
        self.torch = torch
        self.ctx = ctx

    def create_instance(self, ictx: InstanceContext) -> Instance:
        torch = self.torch
        settings = TorchSettings.from_config(self.ctx.config)  # (a bad value fails the load, named)
        settings.apply(torch, ictx.name)
        if ictx.kind == "GPU" and not torch.cuda.is_available():
            # The driver shows a GPU but this torch cannot use it (a CPU build, say): running the
            # instance on the CPU instead would hide that from whoever asked for KIND_GPU.
            raise RuntimeError(f"model '{self.ctx.name}': instance '{ictx.name}' is KIND_GPU but CUDA is not "
                               f"available to torch {torch.__version__}")
        device = torch.device(f"cuda:{ictx.device_id}" if ictx.kind == "GPU" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
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
        return PyTorchInstance(torch, module, device, self.ctx.config, settings)

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
                 settings: TorchSettings = TorchSettings()) -> None:
        self.torch = torch
        self.module = module
        self.device = device
        self.settings = settings
        self.device_inputs = device.type == "cuda"
        self.batched = config.get("max_batch_size", 0) > 0
        self.batch_io = BatchIO(config)
        self.input_names = _order([t["name"] for t in config.get("input", [])] + self.batch_io.targets)
        self.output_names = _order([t["name"] for t in config.get("output", [])])
        self.by_keyword = False
        try:
            args = [a.name for a in module.forward.schema.arguments][1:]  # drop self
            if not all(_INDEXED.match(n) for n in self.input_names) and set(args) == set(self.input_names):
                self.input_names = args
                self.by_keyword = True
        except (AttributeError, RuntimeError):
            pass

    def execute(self, requests: list[Request]) -> list[Response]:
        torch = self.torch
        sizes = [next(iter(r.inputs.values())).shape[0] if self.batched and r.inputs else 1 for r in requests]
        io = self.batch_io
        inputs = [r.inputs for r in requests]
        generated = io.batch_inputs(inputs)
        tensors: list[Any] = []
        for name in self.input_names:
            if name in generated:
                tensors.append(torch.from_numpy(generated[name]).to(self.device))
            elif name not in requests[0].inputs:  # an optional input left out (a batch shares its inputs' names)
                tensors.append(None)
            else:
                tensors.append(self._input(io.parts(name, [i[name] for i in inputs])))
        while tensors and tensors[-1] is None:
            tensors.pop()  # trailing absent inputs are not passed, so forward()'s defaults apply
        with self.settings.running(torch):
            result = self.module(*tensors)
        if isinstance(result, dict):
            outputs = {k: v for k, v in result.items()}
        else:
            if isinstance(result, torch.Tensor):
                result = (result,)
            if len(result) < len(self.output_names):
                raise RuntimeError(f"model returned {len(result)} outputs, config declares "
                                   f"{len(self.output_names)}")
            outputs = dict(zip(self.output_names, result))
        on_device = frozenset().union(*(r.device_outputs for r in requests)) if self.device_inputs else ()
        host = {k: v.detach() if k in on_device else device_tensors.host_array(v) for k, v in outputs.items()}
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

    def _input(self, parts: list[Any]) -> Any:
        """One input of the batch as a tensor on the instance's device: host arrays concatenated
        and copied once; device tensors (a client's CUDA region) used as they are when alone."""
        torch = self.torch
        if not any(device_tensors.is_tensor(p) for p in parts):
            arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if not arr.flags.writeable:
                arr = arr.copy()
            return torch.from_numpy(arr).to(self.device)
        tensors = [(p if device_tensors.is_tensor(p) else torch.from_numpy(np.array(p))).to(self.device)
                   for p in parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
