"""Advanced indexing (`x[idx]`, `x[mask]`, `x[mask] = v`, `index_put_`).

Index tensors may live on the CPU, as CUDA accepts them for these ops (and only these:
`index_select`, `gather` & co. refuse another device there too): they are copied to the
indexed tensor's device first.  A boolean mask's nonzero() positions decide the result's shape,
so a device mask synchronises (as on CUDA); then the integer-index lowering runs."""
import warnings

import torch

from .kernels import kernel_for

aten = torch.ops.aten


def _check_masks(x, indices):
    """PyTorch's checks of mask indices: each mask's shape equals the dims it covers (nonzero()
    alone would select rows of a mismatched mask), and uint8 masks are deprecated."""
    d = 0
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            if i.dtype == torch.uint8:
                warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a "
                              "dtype torch.bool instead.")
            for j, n in enumerate(i.shape):
                if d + j >= x.dim() or x.shape[d + j] != n:
                    raise IndexError(
                        f"The shape of the mask {list(i.shape)} at index {j} does not match the "
                        f"shape of the indexed tensor {list(x.shape)} at index {d + j}")
            d += i.dim()
        else:
            d += 1


def _integer_indices(x, indices):
    _check_masks(x, indices)
    out = []
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            out.extend(i.nonzero().unbind(1))
        else:
            out.append(i)
    # A 0-dim CPU index is an ordinary traced operand already; the rest are copied over.
    return [i.to(x.device) if i is not None and i.device != x.device and i.dim() else i for i in out]


# An XLA scatter compiles slowly (about a second per index shape on the CPU), and loops that
# accumulate a new number of indices each call (PyTorch's duplicate-index tests, data-dependent
# masks) would compile one each.  A single 1-D index of an accumulating index_put is padded to a
# power-of-two count instead: each padded entry adds -0.0 (0 for integers, False for bools) at
# index 0, which changes no value, and only the cheap padding ops compile per count.
_MIN_BUCKET = 16


def _bucketed(x, indices, values):
    if len(indices) != 1 or indices[0] is None or indices[0].dim() != 1 or x.dim() == 0 \
            or x.shape[0] == 0 or values.dtype != x.dtype:
        return indices, values
    idx = indices[0]
    n = idx.shape[0]
    size = max(_MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
    shape = (n,) + tuple(x.shape[1:])
    if size == n or tuple(torch.broadcast_shapes(values.shape, shape)) != shape:
        return indices, values  # a mismatch raises PyTorch's error unpadded
    zero = -0.0 if x.is_floating_point() or x.is_complex() else 0
    values = torch.cat([values.expand(shape), values.new_full((size - n,) + shape[1:], zero)])
    return [torch.cat([idx, idx.new_zeros(size - n)])], values


def register(lib):
    index, index_put, index_put_, impl = (
        kernel_for(aten.index.Tensor), kernel_for(aten.index_put.default),
        kernel_for(aten.index_put_.default), kernel_for(aten._index_put_impl_.default))

    def index_kernel(x, indices):
        return index(x, _integer_indices(x, indices))

    def indices_values(x, indices, values, accumulate):
        indices = _integer_indices(x, indices)
        return _bucketed(x, indices, values) if accumulate else (indices, values)

    def index_put_kernel(x, indices, values, accumulate=False):
        return index_put(x, *indices_values(x, indices, values, accumulate), accumulate)

    def index_put__kernel(x, indices, values, accumulate=False):
        return index_put_(x, *indices_values(x, indices, values, accumulate), accumulate)

    def index_put_impl_kernel(x, indices, values, accumulate=False, unsafe=False):
        return impl(x, *indices_values(x, indices, values, accumulate), accumulate, unsafe)

    lib.impl(aten.index.Tensor, index_kernel, "PrivateUse1")
    lib.impl(aten.index_put.default, index_put_kernel, "PrivateUse1")
    lib.impl(aten.index_put_.default, index_put__kernel, "PrivateUse1")
    lib.impl(aten._index_put_impl_.default, index_put_impl_kernel, "PrivateUse1")
    return {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}
