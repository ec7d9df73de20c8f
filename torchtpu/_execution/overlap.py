"""PyTorch's memory-overlap errors for ops that write into existing tensors (in-place, out=).

A tpu op computes every result from the old values before writing, so an overlapping write
would quietly give an answer where PyTorch raises. The rules are ATen's (MemoryOverlap.h):
elementwise ops refuse an output that maps several elements to one address, and one that
partly overlaps an input; ops that gather (cat, index_select, take...) refuse any overlap.
They depend only on layouts and which storages are shared, so they run when an op's
executable is built; a nonzero offset is not part of the key (op_keys: it is an argument), so
an executable whose written storage another of its arguments shares checks again at each call."""
import torch

try:  # torch >= 2.11 (the symbolic-shape-safe name)
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
except ImportError:  # older releases: the same check under its old name
    from torch._prims_common import is_non_overlapping_and_dense

from .._core import registry

_NO_OVERLAP = {"aten::cat", "aten::index_select", "aten::take", "aten::masked_select",
               "aten::gather", "aten::index_put_", "aten::_index_put_impl_", "aten::index_add_",
               "aten::index_copy_", "aten::put_", "aten::scatter_", "aten::masked_scatter_",
               "aten::index_fill_"}
# index_put_, masked_fill_ and index_fill_ of an expanded tensor only warn on the CPU (a
# deprecation) and write its one element; a tpu write through a view with zero strides would
# keep none of the writes, so they are refused like the other ops (docs/pytorch_test_suites.md).
# Ops that only refuse an output mapping several elements to one address.
_OUTPUT_ONLY = {"aten::bernoulli", "aten::bernoulli_", "aten::uniform_", "aten::normal_", "aten::random_",
                "aten::exponential_", "aten::geometric_", "aten::cauchy_", "aten::log_normal_",
                "aten::linspace", "aten::logspace", "aten::range", "aten::arange"}

# Elementwise ops without the pointwise tag on their functional overload (ATen's kernels are
# TensorIterator loops all the same, so they refuse overlapping writes like the tagged ones).
_UNTAGGED_POINTWISE = {"aten::hardswish"}

# ATen builds these loops without the overlap check (threshold_: writing the same value twice
# is harmless, so an expanded tensor may be thresholded in place).
_UNCHECKED = {"aten::threshold_"}

# ATen's words for a written tensor overlapping itself, and overlapping an input
INTERNAL_MESSAGE = ("unsupported operation: more than one element of the written-to tensor "
                    "refers to a single memory location. Please clone() the tensor before "
                    "performing the operation.")
BETWEEN_MESSAGE = ("unsupported operation: some elements of the input tensor and the written-to "
                   "tensor refer to a single memory location. Please clone() the tensor before "
                   "performing the operation.")
NONE, PARTIAL, FULL = range(3)  # how two tensors overlap (overlap_between)


def check(kernel, vals, resized):
    """Raise PyTorch's error if `kernel`'s call on `vals` writes overlapping memory. ATen's
    gathering and random ops check the outputs they are given; elementwise ops check them once
    resized (`resized`)."""
    name = kernel.overload._schema.name
    if name == "aten::conj_physical_" and not vals[0].is_complex() or name in _UNCHECKED:
        return  # (conj_physical_ of a real tensor: ATen returns before iterating)
    if _elementwise(kernel) and name not in _NO_OVERLAP:
        if not resized:
            return
    elif resized or name not in _NO_OVERLAP and name not in _OUTPUT_ONLY:
        return
    written, read = [], []
    for i, (a, v) in enumerate(zip(kernel.args, vals)):
        tensors = [t for t in (v if isinstance(v, (list, tuple)) else [v])
                   if isinstance(t, torch.Tensor) and t.device.type == "tpu"]
        (written if a.is_write else read).extend(tensors)
    for w in written:
        if internal_overlap(w):
            raise RuntimeError(INTERNAL_MESSAGE)
        if name in _OUTPUT_ONLY:
            continue
        for r in read:
            status = overlap_between(w, r)
            if status == PARTIAL or (status == FULL and name in _NO_OVERLAP):
                raise RuntimeError(BETWEEN_MESSAGE)


def _elementwise(kernel):
    """Whether ATen runs the op as a TensorIterator loop: our arithmetic (promoted to the
    result's dtype) and every op PyTorch tags pointwise (elu_, relu_, sign_, where(out=)...)."""
    if kernel.low.promote is registry.Promote.RESULT:
        return True
    functional = kernel.functional or kernel.inplace_of or kernel.overload
    return (torch.Tag.pointwise in functional.tags
            or functional._schema.name in _UNTAGGED_POINTWISE)


def internal_overlap(t):
    if is_non_overlapping_and_dense(t):
        return False
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def overlap_between(a, b):
    if a is b:
        return FULL
    if a.numel() == 0 or b.numel() == 0:
        return NONE
    if not (is_non_overlapping_and_dense(a) and is_non_overlapping_and_dense(b)):
        return NONE  # ATen: too hard to tell, allowed
    if a.untyped_storage()._tpu is not b.untyped_storage()._tpu:
        return NONE
    a_begin = a.storage_offset() * a.element_size()
    b_begin = b.storage_offset() * b.element_size()
    a_end, b_end = a_begin + a.numel() * a.element_size(), b_begin + b.numel() * b.element_size()
    if a_begin == b_begin and a_end == b_end:
        return FULL if a.stride() == b.stride() else PARTIAL
    return PARTIAL if a_begin < b_end and b_begin < a_end else NONE
