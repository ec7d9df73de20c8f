"""Meta kernels PyTorch lacks for ops the table lowers. PyTorch's meta kernels give every tpu
op its output shapes and dtypes, so an op without one could not run on tpu."""
import warnings

import torch

_lib = torch.library.Library("aten", "IMPL")


def _impl(name, fn):
    try:
        _lib.impl(name, fn, "Meta")
    except RuntimeError as e:
        # Older PyTorch releases register some of these meta kernels in Python themselves (and
        # a failed import leaves ours registered); either one serves.
        if "already a kernel registered from python" not in str(e):
            raise


def _logcumsumexp(x, dim):
    torch._prims_common.canonicalize_dim(x.dim(), dim)  # IndexError: Dimension out of range
    return torch.empty_like(x)


def warn_resized(out, shape):
    if out.numel() > 0:  # ATen's resize_output warning (the Python port words it apart)
        warnings.warn(f"An output with one or more elements was resized since it had shape "
                      f"{list(out.shape)}, which does not match the required output shape "
                      f"{list(shape)}. This behavior is deprecated, and in a future PyTorch "
                      "release outputs will not be resized unless they have zero elements. You "
                      "can explicitly reuse an out tensor t by resizing it, inplace, to zero "
                      "elements with t.resize_(0).", stacklevel=3)


def _logcumsumexp_out(x, dim, *, out):
    # The CPU kernel (reached from logcumsumexp(out=), which checks the dtypes) resizes out as
    # ATen's resize_output does, warning in its words when out had elements.
    _logcumsumexp(x, dim)
    if out.shape != x.shape:
        warn_resized(out, tuple(x.shape))
        out.resize_(x.shape)
    return out


def _geqrf(a):
    m, n = a.shape[-2:]
    return (torch.empty_like(a).mT.contiguous().mT,  # LAPACK's column-major result
            a.new_empty(a.shape[:-2] + (min(m, n),)))


_impl("_logcumsumexp", _logcumsumexp)
_impl("_logcumsumexp.out", _logcumsumexp_out)
_impl("geqrf", _geqrf)


def _histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    return x.new_empty((bins,)), x.new_empty((bins + 1,))


def _histogram_bins_tensor(x, bins, *, weight=None, density=False):
    return x.new_empty((bins.numel() - 1,)), x.new_empty(bins.shape)


_impl("histogram.bin_ct", _histogram_bin_ct)
_impl("histogram.bins_tensor", _histogram_bins_tensor)


def _check_histogramdd(x, bins):
    if len(bins) != x.shape[-1]:
        raise RuntimeError(f"histogramdd: The size of bins must be equal to the innermost "
                           f"dimension of the input. Got {len(bins)} bins and {x.shape[-1]} "
                           "dimensions.")


def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    _check_histogramdd(x, bins)
    return [x.new_empty((n + 1,)) for n in bins]


def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    _check_histogramdd(x, bins)
    return x.new_empty(tuple(bins))


def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    _check_histogramdd(x, bins)
    return x.new_empty(tuple(b.numel() - 1 for b in bins))


_impl("_histogramdd_bin_edges", _histogramdd_bin_edges)
_impl("_histogramdd_from_bin_cts", _histogramdd_from_bin_cts)
_impl("_histogramdd_from_bin_tensors", _histogramdd_from_bin_tensors)


def _like_self(grad, x, *args, **kwargs):
    return torch.empty_like(x)


_impl("multi_margin_loss_backward", _like_self)
_impl("multilabel_margin_loss_backward", _like_self)


_FLOATS = (torch.float16, torch.float32, torch.float64)
_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}


def _complex(real, imag):
    # PyTorch's own meta kernel asserts; its device kernels raise these RuntimeErrors.
    if real.dtype not in _FLOATS or imag.dtype not in _FLOATS:
        raise RuntimeError(f"Expected both inputs to be Half, Float or Double tensors but got "
                           f"{dtype_name(real.dtype)} and {dtype_name(imag.dtype)}")
    if real.dtype != imag.dtype:
        raise RuntimeError(f"Expected object of scalar type {dtype_name(real.dtype)} but got scalar "
                           f"type {dtype_name(imag.dtype)} for second argument")
    shape = torch.broadcast_shapes(real.shape, imag.shape)
    return real.new_empty(shape, dtype=_COMPLEX_OF[real.dtype])


def _complex_out(real, imag, *, out):
    result = _complex(real, imag)
    if out.dtype != result.dtype:  # the CPU kernel writes no other dtype (no cast)
        raise RuntimeError(f"Expected object of scalar type {dtype_name(result.dtype)} but got "
                           f"scalar type {dtype_name(out.dtype)} for argument 'out'")
    return out.resize_(result.shape)


def _aminmax_out(x, *, dim=None, keepdim=False, min, max):
    for out in (min, max):
        if out.dtype != x.dtype:  # the CPU kernel writes no other dtype (no cast)
            raise RuntimeError(f"Expected out tensor to have dtype {c10_name(x.dtype)}, but got "
                               f"{c10_name(out.dtype)} instead")
    result, _ = torch.aminmax(x, dim=dim, keepdim=keepdim)
    return min.resize_(result.shape), max.resize_(result.shape)


def c10_name(dtype):
    """The C++ type name c10 messages use for a dtype."""
    return {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
            torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int",
            torch.int16: "short int", torch.int8: "signed char", torch.uint8: "unsigned char",
            torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>"}.get(
        dtype, str(dtype).removeprefix("torch."))


def dtype_name(dtype):
    return {torch.float16: "Half", torch.float32: "Float", torch.float64: "Double",
            torch.int32: "Int", torch.int64: "Long", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte", torch.bool: "Bool", torch.bfloat16: "BFloat16",
            torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
            torch.complex128: "ComplexDouble"}.get(
        dtype, str(dtype))


def _no_outputs(*args, **kwargs):
    """Ops that only mutate their arguments in place have nothing to infer; the fused optimizer
    steps' lowerings check their arguments (`validate`)."""


for _name in ("_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr", "_fused_sgd_",
              "_fused_sgd_.tensor_lr", "_fused_adagrad_", "_fused_adagrad_.tensor_lr"):
    # Only where this PyTorch release has the overload and no meta kernel of its own.
    _op, _, _ov = _name.partition(".")
    _packet = getattr(torch.ops.aten, _op, None)
    if (_packet is not None and (_ov or "default") in _packet.overloads()
            and not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_name}", "Meta")):
        _impl(_name, _no_outputs)
_impl("complex", _complex)
_impl("complex.out", _complex_out)
_impl("aminmax.out", _aminmax_out)
_impl("fractional_max_pool3d_backward", _like_self)
_impl("_ctc_loss_backward", _like_self)


def _check_rnn_cell(input_gates, hidden_gates, input_bias, hidden_bias, factor, prev_hidden):
    # PyTorch's own size checks; its device check dereferences the optional biases, so absent
    # ones are stood in for by biases of the expected size.
    from torch._meta_registrations import rnn_cell_checkSizes
    if input_bias is None and hidden_bias is None:
        input_bias = hidden_bias = input_gates.new_empty(input_gates.shape[-1:])
    rnn_cell_checkSizes(input_gates, hidden_gates, input_bias, hidden_bias, factor, prev_hidden)


def _fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    _check_rnn_cell(input_gates, hidden_gates, input_bias, hidden_bias, 4, cx)
    return (torch.empty_like(cx, memory_format=torch.contiguous_format),
            torch.empty_like(cx, memory_format=torch.contiguous_format),
            torch.empty_like(input_gates, memory_format=torch.contiguous_format))


def _fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    _check_rnn_cell(input_gates, hidden_gates, input_bias, hidden_bias, 3, hx)
    # workspace: the r and z pre-activations, the input's and the hidden's n part, hx
    return (torch.empty_like(hx, memory_format=torch.contiguous_format),
            hx.new_empty((hx.shape[0], hx.shape[1] * 5)))


def _fused_gru_cell_backward(grad_hy, workspace, has_bias):
    gates = grad_hy.new_empty((grad_hy.shape[0], grad_hy.shape[1] * 3))
    bias = gates.new_empty(gates.shape[1:]) if has_bias else None
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, \
        None if bias is None else torch.empty_like(bias)


_impl("_thnn_fused_lstm_cell", _fused_lstm_cell)
_impl("_thnn_fused_gru_cell", _fused_gru_cell)
_impl("_thnn_fused_gru_cell_backward", _fused_gru_cell_backward)


def _aminmax(x, dim=None, keepdim=False):
    return torch.aminmax(x) if dim is None else torch.aminmax(x, dim=dim, keepdim=keepdim)


_impl("_aminmax", _aminmax)
_impl("_aminmax.dim", _aminmax)
