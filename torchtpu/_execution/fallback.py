"""What happens to an aten op with no tpu lowering: NotImplementedError naming the overload,
or (with `torch.tpu.enable_cpu_fallback = True`) a run on the CPU, warned once per op."""
import warnings

import torch
from torch.utils._pytree import tree_map

from .._core import metrics, registry
from .._core.metrics import FlushReason
from . import fused
from .transfer import to_host

_warned = set()


def sparse_unsupported(op, *args, **kwargs):
    """Every op on a sparse tpu tensor (the SparsePrivateUse1 and SparseCsrPrivateUse1 keys),
    and every conversion of a tpu tensor to a sparse layout: one error that says what to do,
    instead of the dispatcher's "Could not run ... from the 'Sparsetpu' backend"."""
    name = f"{op._schema.name}.{op._schema.overload_name or 'default'}"
    raise NotImplementedError(
        f"Sparse tensors are not supported on the tpu device ('{name}'): torchtpu holds dense "
        "arrays only. Keep sparse tensors on the CPU, or use the dense equivalent "
        "(index_add_/scatter_add_ for message passing, nn.Embedding(sparse=False)); "
        "see docs/pytorch_test_suites.md.")


def nested_unsupported(op, *args, **kwargs):
    """The same for nested (ragged) tensors: the NestedTensorPrivateUse1 key."""
    name = f"{op._schema.name}.{op._schema.overload_name or 'default'}"
    raise NotImplementedError(
        f"Nested tensors are not supported on the tpu device ('{name}'): torchtpu holds dense "
        "arrays only. Pad the sequences and pass a mask (key_padding_mask in "
        "nn.MultiheadAttention) instead; see docs/pytorch_test_suites.md.")


def _fallback(op, *args, **kwargs):
    name = f"{op._schema.name}.{op._schema.overload_name or 'default'}"
    if "sparse" in op._schema.name:  # _to_sparse, _to_sparse_csr...: the CPU's result cannot come back
        sparse_unsupported(op, *args, **kwargs)
    if not getattr(torch.tpu, "enable_cpu_fallback", False):
        raise NotImplementedError(
            f"The operator '{name}' is not implemented for the tpu device. "
            "Set torch.tpu.enable_cpu_fallback = True to run it on the CPU instead.")
    fused.flush(FlushReason.CPU_FALLBACK, f"{name} (CPU fallback)")
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"torchtpu: '{name}' has no tpu lowering and runs on the CPU "
                      "(torch.tpu.enable_cpu_fallback is on).", stacklevel=3)
    metrics.counters["cpu_fallbacks"] += 1
    metrics.counters[f"cpu_fallback::{name}"] += 1
    device = [None]

    def to_cpu(x):
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            device[0] = device[0] or x.device
            return to_host(x)
        return x

    cpu_args = tree_map(to_cpu, args)
    cpu_kwargs = tree_map(to_cpu, kwargs)
    out = op(*cpu_args, **cpu_kwargs)
    # Mutated tpu arguments get the CPU results written back.
    params = registry.parameters(op)
    for a, orig, result in zip(op._schema.arguments, registry.bind(params, args, kwargs),
                               registry.bind(params, cpu_args, cpu_kwargs)):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if isinstance(orig, torch.Tensor) and orig.device.type == "tpu":
            orig.copy_(result)
    dev = device[0] or torch.device("tpu", torch.tpu.current_device())
    return tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x, out)
