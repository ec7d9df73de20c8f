"""Meta kernels PyTorch lacks for ops the table lowers. PyTorch's meta kernels give every tpu
op its output shapes and dtypes, so an op without one could not run on tpu."""
import torch

_lib = torch.library.Library("aten", "IMPL")


def _logcumsumexp(x, dim):
    torch._prims_common.canonicalize_dim(x.dim(), dim)  # IndexError: Dimension out of range
    return torch.empty_like(x)


def _geqrf(a):
    m, n = a.shape[-2:]
    return (torch.empty_like(a).mT.contiguous().mT,  # LAPACK's column-major result
            a.new_empty(a.shape[:-2] + (min(m, n),)))


_lib.impl("_logcumsumexp", _logcumsumexp, "Meta")
_lib.impl("geqrf", _geqrf, "Meta")


def _histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    return x.new_empty((bins,)), x.new_empty((bins + 1,))


def _histogram_bins_tensor(x, bins, *, weight=None, density=False):
    return x.new_empty((bins.numel() - 1,)), x.new_empty(bins.shape)


_lib.impl("histogram.bin_ct", _histogram_bin_ct, "Meta")
_lib.impl("histogram.bins_tensor", _histogram_bins_tensor, "Meta")
