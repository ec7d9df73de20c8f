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


def register(lib):
    index, index_put, index_put_, impl = (
        kernel_for(aten.index.Tensor), kernel_for(aten.index_put.default),
        kernel_for(aten.index_put_.default), kernel_for(aten._index_put_impl_.default))

    def index_kernel(x, indices):
        return index(x, _integer_indices(x, indices))

    def index_put_kernel(x, indices, values, accumulate=False):
        return index_put(x, _integer_indices(x, indices), values, accumulate)

    def index_put__kernel(x, indices, values, accumulate=False):
        return index_put_(x, _integer_indices(x, indices), values, accumulate)

    def index_put_impl_kernel(x, indices, values, accumulate=False, unsafe=False):
        return impl(x, _integer_indices(x, indices), values, accumulate, unsafe)

    lib.impl(aten.index.Tensor, index_kernel, "PrivateUse1")
    lib.impl(aten.index_put.default, index_put_kernel, "PrivateUse1")
    lib.impl(aten.index_put_.default, index_put__kernel, "PrivateUse1")
    lib.impl(aten._index_put_impl_.default, index_put_impl_kernel, "PrivateUse1")
    return {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}
