"""`torchtpu.export`: a model's StableHLO, for deploying it without PyTorch."""
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import backend, fx_graph


def export(model, args, kwargs=None):
    """The StableHLO (MLIR text) of `model(*args, **kwargs)`: `torch.export` of the model,
    PyTorch's core-ATen decompositions, then the same lowerings eager and compiled execution
    use.  The tensor arguments must be on the tpu device (they fix shapes and dtypes).  The
    module's arguments are the flat (storage-order) arrays of the inputs, parameters and
    buffers in the order the program first reads them, then its scalar constants packed by
    type (float64, int64, bool, complex128 arrays)."""
    kwargs = kwargs or {}
    program = torch.export.export(model, tuple(args), kwargs)
    module = program.run_decompositions(backend._decompositions()).module()
    missing = fx_graph.unsupported_ops(module)
    if missing:
        raise NotImplementedError(f"The operator '{missing[0][0]}' is not implemented for the tpu device")
    flat, spec = tree_flatten((tuple(args), kwargs))
    key, buffers = fx_graph.arguments_key(flat)
    if any(isinstance(k, tuple) and k and k[0] == "host" for k in key):
        raise ValueError("torchtpu.export needs its tensor arguments on the tpu device")

    def call(*flat_args):
        a, k = tree_unflatten(list(flat_args), spec)
        return module(*a, **k)

    return fx_graph.Captured(call, flat, buffers, "export").stablehlo(buffers)
