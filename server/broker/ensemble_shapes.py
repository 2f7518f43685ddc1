"""How a tensor's shape changes between an ensemble's steps of different batching, as Triton's
ensemble scheduler does it.

Every ensemble tensor remembers the batch size of the request that made it: the ensemble's own
request for its inputs, the step's request for a step's outputs, 0 when that model does not
batch (``max_batch_size: 0``). A tensor made without batching that goes into a batching model
(or out of a batching ensemble) gets a leading batch dimension of 1 when its shape matches the
input's configured dims; a batched tensor of batch size 1 that goes into a model without
batching (or out of a non-batching ensemble) loses its leading dimension when its shape does not
already match the configured dims. Anything else passes as it is, and the receiving model's own
checks judge it.
"""
from __future__ import annotations

from collections.abc import Sequence


def dims_match(config_dims: Sequence[int], shape: Sequence[int]) -> bool:
    """Triton's ``CompareDimsWithWildcard``: same rank, and each dimension equal or -1 on either side."""
    return len(config_dims) == len(shape) and all(c == d or c == -1 or d == -1 for c, d in zip(config_dims, shape))


def converted_shape(config_dims: Sequence[int], receiver_batches: bool, tensor_batch: int,
                    shape: list[int]) -> list[int]:
    """The shape a tensor of batch size ``tensor_batch`` (0: made without batching) takes going
    into a tensor configured with ``config_dims`` (no batch dimension) of a model that batches or not."""
    if receiver_batches == (tensor_batch != 0):
        return shape
    if receiver_batches:
        return [1, *shape] if dims_match(config_dims, shape) else shape
    if tensor_batch == 1 and shape and not dims_match(config_dims, shape):
        return shape[1:]
    return shape
