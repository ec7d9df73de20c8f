"""What PyTorch's device-generic test suites found (python -m torchtpu.conformance --pytorch-tests,
docs/pytorch_test_suites.md): one small case per fix, each run on the CPU and on tpu, which must
agree in values (assert_close's tolerance), dtypes, shapes, strides, the exception raised (type
and message) and the warnings given."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401


def _run(call, device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = call(device), None
        except Exception as e:  # noqa: BLE001 - compared with the CPU's below
            result, error = None, e
        if device != "cpu":
            torch.tpu.synchronize()
    messages = sorted([str(w.message).split(" (Triggered internally")[0] for w in caught
                       if not issubclass(w.category, DeprecationWarning)])
    return result, error, messages


def _flat(result):
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in _flat(r)]
    return [result]


def same_on_both(call):
    expected, cpu_error, cpu_warnings = _run(call, "cpu")
    got, tpu_error, tpu_warnings = _run(call, "tpu")
    if cpu_error is not None:
        assert type(tpu_error) is type(cpu_error), (tpu_error, cpu_error)
        assert str(tpu_error) == str(cpu_error)
    else:
        assert tpu_error is None, tpu_error
        for g, e in zip(_flat(got), _flat(expected), strict=True):
            if isinstance(e, torch.Tensor):
                assert g.device.type == "tpu" and g.dtype == e.dtype and g.shape == e.shape
                assert g.stride() == e.stride(), (g.stride(), e.stride())
                torch.testing.assert_close(g.cpu(), e, equal_nan=True)
            else:
                assert g == e
    assert tpu_warnings == cpu_warnings


def _expanded(d):
    return torch.tensor([-0.5], device=d).expand(3, 3)


def _fast_mha(need_weights, padding):
    def call(d):
        torch.manual_seed(0)
        m = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval().to(d)
        q = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(d)
        mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device=d) if padding else None
        with torch.no_grad():
            return m(q, q, q, key_padding_mask=mask, need_weights=need_weights)
    return call


def _encoder_with_padding(nested):
    def call(d):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval().to(d)
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(d)
        with torch.no_grad():
            return enc(x, src_key_padding_mask=torch.tensor([[False] * 5, [False] * 3 + [True] * 2],
                                                            device=d))
    return call


def _inplace_backward(forward):
    def call(d):
        x = torch.randn(4, generator=torch.Generator().manual_seed(0)).to(d).requires_grad_()
        forward(x.clone()).sum().backward()
        return x.grad
    return call


def _out(shape, dtype=torch.float32, transposed=False):
    def make(d):
        t = torch.empty(shape[::-1] if transposed else shape, dtype=dtype, device=d)
        return t.t() if transposed else t
    return make


def _nonzero_out(out):
    def call(d):
        o = out(d)
        torch.nonzero(torch.tensor([[0, 1], [1, 1]], device=d), out=o)
        return o
    return call


def _eye_out(*args, out):
    def call(d):
        o = out(d)
        torch.eye(*args, out=o)
        return o
    return call


def _under_float64_after_float32(op):
    """`op` under the float32 default, then under float64 (which must not reuse the first's
    executable: the default dtype decides an integer division's dtype)."""
    def call(d):
        first = op(d)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return first, op(d)
        finally:
            torch.set_default_dtype(old)
    return call


def _encoder_layer(norm_first, activation, masked):
    """nn.TransformerEncoderLayer in eval mode without grad: PyTorch's fast path, one fused op."""
    def call(d):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, norm_first=norm_first,
                                                 activation=activation).eval().to(d)
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).to(d)
        mask = torch.tensor([[False] * 5, [False, False, False, True, True]], device=d)
        with torch.no_grad():
            return layer(x, src_key_padding_mask=mask if masked else None)
    return call


def _warn_always(call):
    def run(d):
        torch.set_warn_always(True)
        try:
            return [call(d) for _ in range(2)]  # warned each time, not once per process
        finally:
            torch.set_warn_always(False)
    return run


def _filled_narrow(d, fill, dtype=torch.float32):
    """An out= of the right number of elements but another shape keeps its shape (2, 2), filled
    in order, and its base shows it."""
    x = torch.zeros(2, 3, dtype=dtype, device=d)
    fill(x.narrow(1, 1, 2))
    return x


def _igamma_grid(d):
    values = [0.0, 1e-3, 1.0, 10.0, float("inf"), -1.0, float("nan")]
    a, x = torch.tensor(values).repeat_interleave(len(values)), torch.tensor(values).repeat(len(values))
    return a.to(d), x.to(d)


def _pool_grad(pool, shape, *args):
    def call(d):
        x = torch.ones(shape, device=d, requires_grad=True)
        y = pool(x, *args)
        y.sum().backward()
        return y, x.grad
    return call


CASES = {
    # An in-place elementwise op writing overlapping memory: ATen's TensorIterator refuses it.
    "elu_overlap": lambda d: F.elu_(_expanded(d)),
    "leaky_relu_overlap": lambda d: F.leaky_relu_(_expanded(d)),
    "hardswish_overlap": lambda d: F.hardswish(_expanded(d), inplace=True),
    "relu_overlap": lambda d: _expanded(d).relu_(),
    "sign_overlap": lambda d: _expanded(d).sign_(),
    "conj_physical_real_overlap": lambda d: _expanded(d).conj_physical_(),  # a no-op: allowed
    # The backward of an in-place forward with a negative slope is refused.
    "elu_negative_alpha": _inplace_backward(lambda x: F.elu_(x, alpha=-2.0)),
    "celu_negative_alpha": _inplace_backward(lambda x: F.celu_(x, alpha=-2.0)),
    "leaky_relu_negative_slope": _inplace_backward(lambda x: F.leaky_relu_(x, -2.0)),
    "leaky_relu_positive_slope": _inplace_backward(lambda x: F.leaky_relu_(x, 0.2)),
    # out= variants: nonzero resizes to a column-major layout (with resize_output's warning when
    # out had elements), keeps an out of the right shape, refuses another dtype; eye resizes
    # silently; arange warns in its own words.
    "nonzero_out_resized": _nonzero_out(_out((2,), torch.int64)),
    "nonzero_out_kept": _nonzero_out(_out((3, 2), torch.int64, transposed=True)),
    "nonzero_out_dtype": _nonzero_out(_out((0,))),
    "eye_out_resized": _eye_out(3, out=_out((2,))),
    "eye_m_out_kept": _eye_out(3, 2, out=_out((3, 2), transposed=True)),
    "eye_out_bool": _eye_out(2, 3, out=_out((0,), torch.bool)),
    "eye_out_negative": _eye_out(-1, out=_out((0,))),
    "arange_out_resized": lambda d: torch.arange(5, out=torch.empty(3, device=d)),
    "linspace_out_resized": lambda d: torch.linspace(0, 10, 5, out=torch.empty(3, device=d)),
    "logspace_out_int": lambda d: torch.logspace(0, 2, 5, 2, out=torch.empty(0, dtype=torch.int64, device=d)),
    "linspace_out_narrow": lambda d: _filled_narrow(d, lambda o: torch.linspace(0, 3, 4, out=o)),
    "range_out_narrow": lambda d: _filled_narrow(d, lambda o: torch.range(0, 3, out=o)),
    "logspace_out_int_narrow": lambda d: _filled_narrow(
        d, lambda o: torch.logspace(0, 3, 4, 2, out=o), torch.int64),
    "linspace_out_int_permuted": lambda d: torch.linspace(
        0, 9000, 9000, out=torch.zeros(3, 3, 1000, dtype=torch.int64, device=d).permute(2, 0, 1)),
    "linspace_complex_into_float": lambda d: torch.linspace(0, 1j, 5, dtype=torch.float32, device=d),
    "linspace_int_float_bounds": lambda d: torch.linspace(1.7, 10.2, 5, dtype=torch.int64, device=d),
    "logspace_int_float_bounds": lambda d: torch.logspace(0, 1.2, 4, dtype=torch.int64, device=d),
    "linspace_complex_bounds": lambda d: torch.linspace(1, 2 + 1j, 4, device=d),
    "logspace_complex_bounds": lambda d: torch.logspace(1j, 2j, 3, device=d),
    "linspace_out_overlap": lambda d: torch.linspace(0, 1, 10, out=torch.empty(1, device=d).expand(10)),
    "arange_nan_end": lambda d: torch.arange(-5, float("nan"), device=d),
    "arange_inf_end": lambda d: torch.arange(0.5, float("inf"), device=d),
    "range_step": lambda d: torch.range(1, 0.1, -0.3, device=d),
    "range_out_resized": lambda d: torch.range(0, 3, out=torch.empty(2, dtype=torch.int64, device=d)),
    "range_step_sign": lambda d: torch.range(0, 3, -1, device=d),
    "complex_out_dtype": lambda d: torch.complex(torch.ones(2, dtype=torch.float64, device=d),
                                                 torch.ones(2, dtype=torch.float64, device=d),
                                                 out=torch.zeros(2, dtype=torch.float64, device=d)),
    "polar_out_dtype": lambda d: torch.polar(torch.ones(2, device=d), torch.ones(2, device=d),
                                             out=torch.zeros(2, dtype=torch.complex128, device=d)),
    "empty_strided_rank_mismatch": lambda d: torch.tensor(1.0, device=d).new_empty_strided((2,), ()),
    "roll_dims_mismatch": lambda d: torch.ones(2, 4, device=d).roll(shifts=(1,), dims=(1, 2)),
    "roll_no_shifts": lambda d: torch.ones(2, 4, device=d).roll(shifts=(), dims=1),
    # random_(): [0, 2**digits] for floating types, [0, max] for integers; from/to - 1 checked
    # against the dtype's range.
    "random_default_ranges": lambda d: [bool(t.min() >= 0) and bool(t.max() <= hi) and t.dtype
                                        for t, hi in [(torch.empty(1000, dtype=dt, device=d).random_(), hi)
                                                      for dt, hi in [(torch.float16, 2048), (torch.bfloat16, 256),
                                                                     (torch.uint8, 255), (torch.bool, 1)]]],
    "random_to_out_of_bounds": lambda d: torch.empty(3, dtype=torch.uint8, device=d).random_(0, 257),
    "random_bool_out_of_bounds": lambda d: torch.empty(3, dtype=torch.bool, device=d).random_(0, 3),
    "random_bfloat16_precision_warning": lambda d: torch.empty(3, dtype=torch.bfloat16, device=d).random_(0, 2 ** 20).shape,
    "random_from_out_of_bounds": lambda d: torch.empty(3, dtype=torch.uint8, device=d).random_(-1, 3),
    # add/sub's alpha: ATen's checks of it against the computation's dtype.
    "add_int_float_alpha": lambda d: torch.add(torch.ones(3, dtype=torch.int32, device=d), 1, alpha=1.1),
    "add__int_float_alpha": lambda d: torch.ones(3, dtype=torch.int64, device=d).add_(
        torch.ones(3, dtype=torch.int64, device=d), alpha=2.0),
    "add_bool_alpha": lambda d: torch.ones(3, device=d).add(torch.ones(3, device=d), alpha=True),
    "add_bool_bool_alpha": lambda d: torch.ones(3, dtype=torch.bool, device=d).add(
        torch.ones(3, dtype=torch.bool, device=d), alpha=True),
    "sub_complex_alpha": lambda d: torch.sub(torch.ones(3, device=d), torch.ones(3, device=d), alpha=1j),
    "sub_float_alpha": lambda d: torch.sub(torch.ones(3, device=d), torch.ones(3, device=d), alpha=2.5),
    # Results whose dtype is the default dtype's.
    "div_int_default_float64": _under_float64_after_float32(
        lambda d: torch.tensor([1, 2], device=d) / torch.tensor([3, 4], device=d)),
    "true_divide_int_default_float64": _under_float64_after_float32(
        lambda d: torch.true_divide(torch.tensor([1, 2], device=d), torch.tensor([3, 4], device=d))),
    "add_int_float_default_float64": _under_float64_after_float32(
        lambda d: torch.tensor([1, 2], device=d) + 2.5),
    # xlogy/xlog1py: a NaN y gives NaN even where x is zero (here a bool x, promoted).
    "xlogy_bool_nan": lambda d: torch.xlogy(torch.tensor([False, True, False], device=d),
                                            torch.tensor([float("nan"), 2.0, -1.0], device=d)),
    "xlog1py_bool_nan": lambda d: torch.special.xlog1py(
        torch.tensor([False, True, False], device=d), torch.tensor([float("nan"), 2.0, -1.0], device=d)),
    # An integer tensor to a negative integer power: no integer result, refused.
    "pow_int_negative_scalar": lambda d: torch.tensor([2, 3], device=d).pow(-2),
    "pow_int_0dim_negative_scalar": lambda d: torch.tensor(2, device=d) ** -1,
    "pow_int_negative_tensor": lambda d: torch.pow(torch.tensor([2, 3], device=d), torch.tensor([-1, 2], device=d)),
    # igamma/igammac's edge values: PyTorch's cases, in its order (infinite a and x: NaN).
    "igamma_edges": lambda d: torch.igamma(*_igamma_grid(d)),
    "igammac_edges": lambda d: torch.igammac(*_igamma_grid(d)),
    # index_put_ with one mask and a one-element CPU value runs as masked_fill_ (ATen's
    # canDispatchToMaskedFill), which refuses a uint8 mask instead of warning.
    "index_put_uint8_mask_cpu_value": lambda d: torch.zeros(3, device=d).index_put_(
        (torch.tensor([1, 0, 1], dtype=torch.uint8, device=d),), torch.tensor(1.0)),
    "index_put_bool_mask_cpu_value": lambda d: torch.zeros(3, 2, device=d).index_put(
        (torch.tensor([True, False, True], device=d),), torch.tensor(2.0)),
    "index_put_uint8_mask_device_value": lambda d: torch.zeros(3, device=d).index_put_(
        (torch.tensor([1, 0, 1], dtype=torch.uint8, device=d),), torch.ones(2, device=d)),
    "masked_scatter_uint8_mask": lambda d: torch.zeros(3, device=d).masked_scatter_(
        torch.tensor([1, 0, 1], dtype=torch.uint8, device=d), torch.ones(3, device=d)),
    # Warnings.
    "_aminmax_deprecated_warn_always": _warn_always(lambda d: torch._aminmax(torch.arange(4.0, device=d))),
    "searchsorted_non_contiguous": _warn_always(lambda d: torch.searchsorted(
        torch.tensor([[1, 3, 5, 7, 9], [2, 4, 6, 8, 10]], device=d).t().contiguous().t(),
        torch.tensor([[3, 6], [9, 1], [2, 5]], device=d).t())),
    "bucketize_non_contiguous": _warn_always(lambda d: torch.bucketize(
        torch.tensor([[3, 6], [9, 1]], device=d).t(), torch.tensor([1, 3, 5, 7], device=d))),
    # Ops PyTorch's fast paths call.
    "transformer_encoder_layer": _encoder_layer(False, "relu", False),
    "transformer_encoder_layer_norm_first_gelu_masked": _encoder_layer(True, "gelu", True),
    # Reductions: an out of another dtype, a repeated dim, an empty reduced dim.
    "max_dim_out_dtype": lambda d: torch.max(torch.ones(3, 4, device=d), 1, out=(
        torch.empty(0, dtype=torch.int32, device=d), torch.empty(0, dtype=torch.int64, device=d))),
    "amax_out_dtype": lambda d: torch.amax(torch.ones(3, 4, device=d), 1,
                                           out=torch.empty(0, dtype=torch.int32, device=d)),
    "mode_indices_out_dtype": lambda d: torch.mode(torch.ones(3, 4, device=d), 1, out=(
        torch.empty(0, device=d), torch.empty(0, dtype=torch.int32, device=d))),
    "isposinf_out_float": lambda d: torch.isposinf(torch.ones(3, device=d), out=torch.empty(3, device=d)),
    "frexp_out_mantissa_dtype": lambda d: torch.frexp(torch.ones(3, device=d), out=(
        torch.empty(3, dtype=torch.float64, device=d), torch.empty(3, dtype=torch.int32, device=d))),
    "frexp_out_exponent_dtype": lambda d: torch.frexp(torch.ones(3, device=d), out=(
        torch.empty(3, device=d), torch.empty(3, dtype=torch.int64, device=d))),
    "mean_repeated_dim": lambda d: torch.ones(3, 4, device=d).mean((0, -2)),
    "norm_repeated_dim": lambda d: torch.norm(torch.ones(3, 4, device=d), dim=(0, -2)),
    "vector_norm_repeated_dim": lambda d: torch.linalg.vector_norm(torch.ones(3, 4, device=d), dim=(1, 1)),
    "count_nonzero_repeated_dim": lambda d: torch.count_nonzero(torch.ones(3, 4, device=d), dim=(0, 0)),
    "kthvalue_empty_dim": lambda d: torch.kthvalue(torch.ones(2, 0, device=d), 1, 1),
    # all/any store into a bool or uint8 out only.
    "all_out_float": lambda d: torch.all(torch.ones(3, device=d), out=torch.empty(0, device=d)),
    "any_dim_out_int": lambda d: torch.any(torch.ones(3, 2, device=d), 1,
                                           out=torch.empty(0, dtype=torch.int32, device=d)),
    "all_out_uint8": lambda d: torch.all(torch.ones(3, device=d),
                                         out=torch.empty(0, dtype=torch.uint8, device=d)),
    # A view of a one-element storage (strided._plan split it into no dims at all).
    "cartesian_prod_one_element_input": lambda d: torch.cartesian_prod(
        torch.tensor([1], device=d), torch.tensor([1, 2, 3], device=d), torch.tensor([1, 2], device=d)),
    "arange_size_overflow": lambda d: torch.arange(1.175494351e-38, 3.402823466e+38, device=d),
    # Creation: random_(from, None) up to a floating type's largest exact integer, randint's
    # dtype check, repeat_interleave's checks, complex linspace by the CPU kernel's formula.
    "random_from_full_range_bfloat16": lambda d: torch.empty(
        2000, dtype=torch.bfloat16, device=d).random_(-256, None).double().aminmax().max > 200,
    "random_from_full_range_float64": lambda d: torch.empty(
        2000, dtype=torch.float64, device=d).random_(-2 ** 53, None).max() > 2 ** 52,
    "randint_complex": lambda d: torch.randint(6, (2,), dtype=torch.complex64, device=d),
    "repeat_interleave_2d_repeats": lambda d: torch.repeat_interleave(
        torch.arange(4, device=d).reshape(2, 2)),
    "repeat_interleave_float_repeats": lambda d: torch.repeat_interleave(torch.arange(4.0, device=d)),
    "linspace_complex128": lambda d: torch.linspace(-100, 100 + 1j, 401, dtype=torch.complex128, device=d),
    # Scatter/segment reductions: max/min identities, amax/amin, the host-side segment checks,
    # and max's gradient to a NaN result.
    "scatter_reduce_amax_without_self": lambda d: torch.zeros(3, device=d).scatter_reduce_(
        0, torch.tensor([0, 0, 1, 1, 2, 2], device=d),
        torch.tensor([1, float("nan"), -float("inf"), -float("inf"), 2, float("inf")], device=d),
        "amax", include_self=False),
    "scatter_reduce_amin_without_self": lambda d: torch.zeros(2, device=d).scatter_reduce_(
        0, torch.tensor([0, 0, 1], device=d), torch.tensor([float("inf"), float("inf"), 1.0], device=d),
        "amin", include_self=False),
    "segment_reduce_amax": lambda d: torch._segment_reduce(
        torch.tensor([1.0, 5.0, 3.0], device=d), "amax", lengths=torch.tensor([1, 2], device=d)),
    "segment_reduce_lengths_not_summing": lambda d: torch._segment_reduce(
        torch.arange(6.0, device=d), "sum", lengths=torch.tensor([0, 2, 3, 0], device=d), unsafe=False),
    "segment_reduce_negative_length": lambda d: torch._segment_reduce(
        torch.arange(6.0, device=d), "sum", lengths=torch.tensor([1, -2, 4, 3], device=d), unsafe=False),
    "segment_reduce_max_grad_nan": lambda d: _segment_max_grad(d),
    # nn.MultiheadAttention's inference fast path (aten._native_multi_head_attention).
    "multihead_attention_fast_path_padding": _fast_mha(need_weights=True, padding=True),
    "multihead_attention_fast_path_no_weights": _fast_mha(need_weights=False, padding=False),
    "transformer_encoder_padding_mask_dense": _encoder_with_padding(nested=False),
    # nn: rrelu_ in place (and its backward's refusal of a negative slope), nll_loss's uint8
    # target, threshold_ of an expanded tensor.
    "rrelu_inplace_eval": lambda d: torch.nn.functional.rrelu_(torch.tensor([-1.0, 1.0], device=d)),
    "rrelu_inplace_negative_slope_backward": lambda d: torch.nn.functional.rrelu_(
        torch.tensor([-1.0, 1.0], device=d, requires_grad=True).clone(), -5.0, 1.0).backward(
        torch.ones(2, device=d)),
    "nll_loss_uint8_target": lambda d: _nll_uint8(d),
    # test_torch: in-place ops never resize self; indexed writes refuse overlapping memory.
    "atan2_inplace_broadcast_past_self": lambda d: torch.ones(2, 1, device=d).atan2_(torch.ones(2, 3, device=d)),
    "lt_inplace_broadcast_past_self": lambda d: torch.ones(2, 1, device=d).lt_(torch.ones(2, 3, device=d)),
    "add_inplace_broadcast_past_self": lambda d: torch.ones(2, 1, device=d).add_(torch.ones(2, 3, device=d)),
    "lt_inplace_broadcast_within_self": lambda d: torch.ones(2, 3, device=d).lt_(torch.ones(3, device=d)),
    "index_add_expanded_self": lambda d: torch.rand(1, device=d).expand(6).index_add_(
        0, torch.tensor([2, 1, 0], device=d), torch.rand(3, device=d)),
    "index_copy_source_overlaps_self": lambda d: _overlapping_source(d, "index_copy_"),
    "index_add_source_overlaps_self": lambda d: _overlapping_source(d, "index_add_"),
    "scatter_src_is_self": lambda d: (lambda v: v.scatter_(0, torch.tensor([2, 1, 0], device=d), v))(
        torch.ones(3, device=d)),
    "put_expanded_self": lambda d: torch.rand(1, device=d).expand(6).put_(
        torch.tensor([2, 1, 0], device=d), torch.rand(3, device=d)),
    "index_fill_index_is_self": lambda d: torch.tensor([2, 1, 0], device=d).index_fill_(
        0, torch.tensor([2, 1, 0], device=d)[:], 0),
    "index_copy_0dim_index_1d_source": lambda d: torch.zeros(1, device=d).index_copy_(
        0, torch.tensor(0, device=d), torch.full((1,), 3.0, device=d)),
    "index_copy_0dim_index_row": lambda d: torch.zeros(3, 4, device=d).index_copy_(
        0, torch.tensor(1, device=d), torch.ones(1, 4, device=d)),
    "index_fill_complex_scalar_into_float": lambda d: torch.ones(2, 2, device=d).index_fill_(
        1, torch.tensor([0], device=d), 1 + 1j),
    "index_fill_complex_tensor_into_float": lambda d: torch.ones(2, 2, device=d).index_fill_(
        1, torch.tensor([0], device=d), torch.tensor(1 + 1j, device=d)),
    "index_fill_complex_into_complex": lambda d: torch.ones(2, 2, dtype=torch.complex64, device=d).index_fill_(
        1, torch.tensor([0], device=d), 1 + 1j),
    # masked_scatter_ expands its mask to self, as ATen's expand_inplace (in expand's words).
    "masked_scatter_inplace_mask_past_self": lambda d: torch.randn(2, 3, device=d).masked_scatter_(
        torch.ones(3, 2, dtype=torch.bool, device=d), torch.ones(6, device=d)),
    "masked_scatter_inplace_mask_broadcast": lambda d: torch.zeros(2, 3, device=d).masked_scatter_(
        torch.tensor([True, False, True], device=d), torch.arange(6.0, device=d)),
    "searchsorted_scalar_2d_boundaries": lambda d: torch.searchsorted(torch.ones(2, 3, device=d), 1),
    "unique_nans_distinct": lambda d: torch.unique(
        torch.tensor([1.0, float("nan"), 2.0, float("nan"), 1.0], device=d),
        return_inverse=True, return_counts=True),
    "masked_select_out": lambda d: torch.masked_select(
        torch.arange(6.0, device=d).reshape(2, 3), torch.arange(6, device=d).reshape(2, 3) > 2,
        out=torch.empty(5, device=d)),
    "masked_select_out_dtype": lambda d: torch.masked_select(
        torch.arange(6.0, device=d), torch.arange(6, device=d) > 2,
        out=torch.empty(0, dtype=torch.long, device=d)),
    "is_set_to": lambda d: (lambda x: (x.is_set_to(x), x.is_set_to(x.view(6)),
                                       torch.empty(0, device=d).set_(x).is_set_to(x)))(
        torch.arange(6.0, device=d).reshape(2, 3)),
    "searchsorted_scalar": lambda d: torch.searchsorted(torch.tensor([1.0, 3, 5, 7], device=d), 4),
    # nn: Embedding(max_norm=) (embedding_renorm_), convolutions of inputs without channels.
    "embedding_max_norm": lambda d: _embedding_max_norm(d),
    "embedding_renorm_p1": lambda d: torch.embedding_renorm_(
        torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(d),
        torch.tensor([0, 4, 4], device=d), 0.5, 1.0),
    "conv1d_no_input_channels": lambda d: _conv_grads(d, (2, 0, 6), (3, 0, 2)),
    "conv2d_no_input_channels": lambda d: _conv_grads(d, (2, 0, 6, 6), (3, 0, 2, 2)),
    "conv_transpose_weight_without_input_channels": lambda d: torch.nn.functional.conv_transpose1d(
        torch.randn(2, 0, 6, device=d), torch.randn(0, 3, 2, device=d)),
    "threshold_inplace_expanded": lambda d: torch.nn.functional.threshold_(
        torch.tensor([[0.2, 0.7, 0.4]], device=d).expand(3, 3), 0.5, 0.5),
    # Random creation: randperm (and its checks of n), normal's std checks, uniform_'s range.
    "randperm_sorted": lambda d: torch.randperm(100, device=d).sort().values,
    "randperm_float_out_noncontiguous": lambda d: torch.randperm(
        6, out=torch.empty(3, 4, device=d)[:, 1]).sort().values,
    "randperm_n_too_large_for_half": lambda d: torch.randperm(2 ** 11 + 2, dtype=torch.half, device=d),
    "randperm_n_too_large_for_uint8_out": lambda d: torch.randperm(
        2 ** 8 + 1, out=torch.empty(0, dtype=torch.uint8, device=d)),
    "normal_negative_std_tensor": lambda d: torch.normal(0.0, torch.tensor(-1.0, device=d)),
    "normal_negative_std_tensors": lambda d: torch.normal(torch.zeros(2, device=d),
                                                          torch.tensor([1.0, -1.0], device=d)),
    "uniform_range_past_float_max": lambda d: torch.empty(3, device=d).uniform_(-3.4e38, 3.4e38),
    "uniform_float64_past_float32_range": lambda d: torch.empty(
        2000, dtype=torch.float64, device=d).uniform_(-1e300, 1e300).abs().max() > 1e299,
    # logcumsumexp(out=): _logcumsumexp.out had no meta kernel; out resized with ATen's warning,
    # the dtype refused, the dim checked.
    "logcumsumexp_out": lambda d: _logcumsumexp_out(d, torch.zeros(5, 2, device=d)),
    "logcumsumexp_out_resized": lambda d: _logcumsumexp_out(d, torch.zeros(3, device=d), 0),
    "logcumsumexp_out_transposed_input": lambda d: _logcumsumexp_out(
        d, torch.zeros(0, device=d), 0, transposed=True),
    "logcumsumexp_out_dtype": lambda d: torch.logcumsumexp(
        torch.ones(5, 2, dtype=torch.float64, device=d), -1, out=torch.zeros(5, 2, device=d)),
    "logcumsumexp_out_bad_dim": lambda d: _logcumsumexp_out(d, torch.zeros(5, 2, device=d), 2),
    # A random fill's parameter checked on every call, not only the first of its shape and dtype
    # (whose shape inference saw it), then its dtype.
    "cauchy_zero_sigma_after_valid": lambda d: _fill_after_valid(d, lambda t, v: t.cauchy_(0.0, v), 0.5, 0.0),
    "exponential_negative_lambda_after_valid": lambda d: _fill_after_valid(
        d, lambda t, v: t.exponential_(v), 0.5, -0.5),
    "exponential_nan_lambda": lambda d: torch.empty(1, device=d).exponential_(float("nan")),
    "exponential_inf_lambda": lambda d: torch.empty(3, device=d).exponential_(float("inf")),
    "cauchy_inf_median": lambda d: torch.empty(3, device=d).cauchy_(float("inf"), 0.5),
    "geometric_p_one_after_valid": lambda d: _fill_after_valid(d, lambda t, v: t.geometric_(v), 0.5, 1.0),
    "log_normal_negative_std_after_valid": lambda d: _fill_after_valid(
        d, lambda t, v: t.log_normal_(0.0, v), 0.5, -1.0),
    "exponential_int": lambda d: torch.empty(3, dtype=torch.int64, device=d).exponential_(),
    "exponential_complex_negative_lambda": lambda d: torch.empty(
        3, dtype=torch.complex64, device=d).exponential_(-1.0),
    "cauchy_uint8": lambda d: torch.empty(3, dtype=torch.uint8, device=d).cauchy_(),
    "log_normal_int": lambda d: torch.empty(3, dtype=torch.int32, device=d).log_normal_(),
    "geometric_bool": lambda d: torch.empty(3, dtype=torch.bool, device=d).geometric_(0.5),
    # Shifts: an in-place shift's overlap and cast errors before the dtype's refusal, which
    # names the CPU kernel.
    "ilshift_float_partial_overlap": lambda d: (lambda x: x[:-1].__ilshift__(x[1:]))(torch.rand(3, device=d)),
    "irshift_float_partial_overlap": lambda d: (lambda x: x[:-1].__irshift__(x[1:]))(torch.rand(3, device=d)),
    "ilshift_float_expanded": lambda d: torch.rand(1, device=d).expand(3).__ilshift__(1),
    "ilshift_long_by_float": lambda d: torch.ones(3, dtype=torch.long, device=d).__ilshift__(1.5),
    "ilshift_float": lambda d: torch.rand(3, device=d).__ilshift__(2),
    "rshift_bool": lambda d: torch.ones(3, dtype=torch.bool, device=d) >> torch.ones(3, dtype=torch.bool, device=d),
    "bitwise_left_shift_float": lambda d: torch.bitwise_left_shift(torch.rand(3, device=d), 1),
    # abs(out=) of a complex input: into a complex out of its dtype (imaginary parts of zero, laid
    # out as the input when resized), into a real out it casts to; other dtypes in ATen's words.
    "abs_complex_into_complex_out": lambda d: torch.abs(
        _complex_2x2(d), out=torch.empty(2, 2, dtype=torch.complex64, device=d)),
    "abs_complex_into_empty_complex_out": lambda d: torch.abs(
        _complex_2x2(d).t(), out=torch.empty(0, dtype=torch.complex64, device=d)),
    "abs_complex_into_resized_complex_out": lambda d: torch.abs(
        _complex_2x2(d), out=torch.empty(3, dtype=torch.complex64, device=d)),
    "abs_complex_into_float64_out": lambda d: torch.abs(
        _complex_2x2(d), out=torch.empty(1, dtype=torch.float64, device=d)),
    "abs_complex_into_complex128_out": lambda d: torch.abs(
        _complex_2x2(d), out=torch.empty(2, 2, dtype=torch.complex128, device=d)),
    "abs_complex_into_int_out": lambda d: torch.abs(
        _complex_2x2(d), out=torch.empty(2, 2, dtype=torch.int64, device=d)),
    "abs_complex_into_expanded_out": lambda d: torch.abs(
        _complex_2x2(d), out=torch.empty(1, device=d).expand(2, 2)),
    "abs_float_into_float64_out": lambda d: torch.abs(
        torch.ones(2, device=d), out=torch.empty(2, dtype=torch.float64, device=d)),
    "abs_inplace_complex": lambda d: _complex_2x2(d).abs_(),
    "abs_inplace_float": lambda d: torch.tensor([-1.5, 2.0], device=d).abs_(),
    "angle_complex_into_complex_out": lambda d: torch.angle(
        _complex_2x2(d), out=torch.empty(2, 2, dtype=torch.complex64, device=d)),
    # Pooling of empty batches and to empty outputs: empty results and gradients, the CPU's
    # checks in its words (PyTorch's meta kernels word some apart).
    "max_pool1d_empty_batch": _pool_grad(F.max_pool1d, (0, 4, 10), 3, 2),
    "max_pool2d_empty_batch": _pool_grad(F.max_pool2d, (0, 4, 10, 8), 3, 2),
    "max_pool3d_empty_batch": _pool_grad(F.max_pool3d, (0, 4, 5, 4, 3), 3, 2),
    "adaptive_max_pool1d_empty_batch": _pool_grad(F.adaptive_max_pool1d, (0, 4, 10), 3),
    "adaptive_max_pool2d_empty_batch": _pool_grad(F.adaptive_max_pool2d, (0, 4, 10, 8), 3),
    "adaptive_max_pool3d_empty_batch": _pool_grad(F.adaptive_max_pool3d, (0, 4, 5, 4, 3), 3),
    "adaptive_max_pool2d_empty_channels": _pool_grad(F.adaptive_max_pool2d, (1, 0, 10, 8), 3),
    "adaptive_avg_pool1d_empty_batch": _pool_grad(F.adaptive_avg_pool1d, (0, 10), 5),
    "adaptive_avg_pool2d_empty_batch": _pool_grad(F.adaptive_avg_pool2d, (0, 10, 10), 5),
    "adaptive_avg_pool2d_empty_spatial": _pool_grad(F.adaptive_avg_pool2d, (2, 3, 0, 10), 5),
    "adaptive_avg_pool2d_output_size_0_backward": _pool_grad(F.adaptive_avg_pool2d, (1, 4, 10, 9), 0),
    "adaptive_avg_pool3d_output_size_0_backward": _pool_grad(F.adaptive_avg_pool3d, (1, 4, 10, 9), 0),
    "adaptive_max_pool2d_output_size_0_backward": _pool_grad(F.adaptive_max_pool2d, (1, 4, 10, 9), 0),
    "adaptive_max_pool1d_output_size_0_backward": _pool_grad(F.adaptive_max_pool1d, (1, 4), 0),
    "max_unpool2d_empty_batch": lambda d: _unpool_empty_batch(d, F.max_pool2d, F.max_unpool2d, (0, 3, 4, 4)),
    "max_unpool3d_empty_batch": lambda d: _unpool_empty_batch(d, F.max_pool3d, F.max_unpool3d, (0, 3, 4, 4, 4)),
    "fractional_max_pool2d_output_size_0": lambda d: torch.ops.aten.fractional_max_pool2d(
        torch.rand(2, 3, 8, 8, device=d), (2, 2), (0, 1), torch.rand(2, 3, 2, device=d)),
    "fractional_max_pool3d_output_size_0_unbatched": lambda d: torch.ops.aten.fractional_max_pool3d(
        torch.rand(3, 8, 8, 8, device=d), (3, 2, 2), (0, 1, 1), torch.rand(1, 3, 3, device=d)),
    "fractional_max_pool3d_too_few_samples": lambda d: torch.ops.aten.fractional_max_pool3d(
        torch.rand(1, 3, 8, 8, 8, device=d), (3, 2, 2), (1, 1, 1), torch.rand(0, 3, 3, device=d)),
    "fractional_max_pool3d_samples_of_2d": lambda d: torch.ops.aten.fractional_max_pool3d(
        torch.rand(1, 3, 8, 8, 8, device=d), (3, 2, 2), (1, 1, 1), torch.rand(1, 3, 2, device=d)),
    "fractional_max_pool2d_samples_dtype": lambda d: torch.ops.aten.fractional_max_pool2d(
        torch.rand(1, 3, 8, 8, device=d), (2, 2), (2, 2), torch.rand(1, 3, 2, dtype=torch.float64, device=d)),
    "fractional_max_pool2d_kernel_size": lambda d: torch.ops.aten.fractional_max_pool2d(
        torch.rand(1, 3, 8, 8, device=d), (2,), (2, 2), torch.rand(1, 3, 2, device=d)),
    "fractional_max_pool2d_pool_too_large": lambda d: torch.ops.aten.fractional_max_pool2d(
        torch.rand(1, 3, 8, 8, device=d), (2, 2), (3, 8), torch.rand(1, 3, 2, device=d)),
    "fractional_max_pool3d_empty_channels": lambda d: torch.ops.aten.fractional_max_pool3d(
        torch.rand(1, 0, 8, 8, 8, device=d), (2, 2, 2), (2, 2, 2), torch.rand(1, 0, 3, device=d)),
    # searchsorted/bucketize: side and sorter checked, out's dtype refused rather than cast.
    "searchsorted_out_float": lambda d: torch.searchsorted(
        torch.arange(5, device=d), torch.arange(5, device=d), out=torch.empty(5, device=d)),
    "searchsorted_out_int64_with_out_int32": lambda d: torch.searchsorted(
        torch.arange(5, device=d), torch.arange(5, device=d), out_int32=True,
        out=torch.empty(5, dtype=torch.long, device=d)),
    "searchsorted_scalar_out_resized": lambda d: torch.searchsorted(
        torch.arange(5, device=d), 3, out=torch.empty(3, dtype=torch.long, device=d)),
    "bucketize_out_int32": lambda d: torch.bucketize(
        torch.arange(5, device=d), torch.arange(5, device=d), out_int32=True, right=True,
        out=torch.empty(0, dtype=torch.int32, device=d)),
    "bucketize_out_int32_flag_off": lambda d: torch.bucketize(
        torch.arange(5, device=d), torch.arange(5, device=d), out=torch.empty(0, dtype=torch.int32, device=d)),
    "searchsorted_bad_side": lambda d: torch.searchsorted(
        torch.arange(5, device=d), torch.arange(5, device=d), side="bad"),
    "searchsorted_side_opposite_right": lambda d: torch.searchsorted(
        torch.arange(5, device=d), torch.arange(5, device=d), side="left", right=True),
    "searchsorted_sorter_size": lambda d: torch.searchsorted(
        torch.arange(5.0, device=d), 2.5, sorter=torch.arange(4, device=d)),
    "searchsorted_sorter_dtype": lambda d: torch.searchsorted(
        torch.arange(5.0, device=d), 2.5, sorter=torch.arange(5.0, device=d)),
    "searchsorted_sorter_out_of_range": lambda d: torch.searchsorted(
        torch.arange(3.0, device=d), 2.5, sorter=torch.tensor([0, 1, 3], device=d)),
    "searchsorted_sorter_negative": lambda d: torch.searchsorted(
        torch.arange(3.0, device=d), torch.ones(2, device=d), sorter=torch.tensor([-1, 1, 2], device=d)),
    # multilabel_margin_loss: ATen's shape rules (a vector's target of as many elements, a 0-dim
    # unreduced loss) and its labels up to the first -1 only.
    "multilabel_margin_loss_scalar_input_none": lambda d: _margin_grad(
        d, F.multilabel_margin_loss, torch.tensor(0.3), torch.tensor([0]), "none"),
    "multilabel_margin_loss_vector_scalar_target": lambda d: _margin_grad(
        d, F.multilabel_margin_loss, torch.tensor([0.2]), torch.tensor(0), "mean"),
    "multilabel_margin_loss_vector_none": lambda d: _margin_grad(
        d, F.multilabel_margin_loss, torch.tensor([0.1, 0.9, -0.2]), torch.tensor([2, -1, 0]), "none"),
    "multilabel_margin_loss_rows_after_end": lambda d: _margin_grad(
        d, F.multilabel_margin_loss, torch.tensor([[0.1, 0.9, -0.2], [1.0, 2.0, 3.0]]),
        torch.tensor([[2, -1, 0], [1, 0, -1]]), "sum"),
    "multilabel_margin_loss_matrix_vector_target": lambda d: _margin_grad(
        d, F.multilabel_margin_loss, torch.tensor([[0.4]]), torch.tensor([0]), "none"),
    "multilabel_margin_loss_empty_vector": lambda d: _margin_grad(
        d, F.multilabel_margin_loss, torch.empty(0), torch.empty(0, dtype=torch.long), "none"),
    # multi_margin_loss: ATen's shape rules and words (the unreduced loss of the target's shape).
    "multi_margin_loss_scalar_input_none": lambda d: _margin_grad(
        d, F.multi_margin_loss, torch.tensor(0.3), torch.tensor(0), "none"),
    "multi_margin_loss_vector_input_none": lambda d: _margin_grad(
        d, F.multi_margin_loss, torch.tensor([0.1, 0.9, -0.2]), torch.tensor([2]), "none"),
    "multi_margin_loss_matrix_weighted": lambda d: F.multi_margin_loss(
        torch.tensor([[0.1, 0.9, -0.2], [1.0, 2.0, 3.0]], device=d), torch.tensor([2, 1], device=d),
        p=2, margin=0.5, weight=torch.tensor([0.5, 2.0, 1.0], device=d), reduction="none"),
    "multi_margin_loss_target_size": lambda d: F.multi_margin_loss(
        torch.ones(2, 3, device=d), torch.tensor([1], device=d)),
    "multi_margin_loss_target_2d": lambda d: F.multi_margin_loss(
        torch.tensor(0.3, device=d), torch.tensor([[0]], device=d)),
    "multi_margin_loss_weight_size": lambda d: F.multi_margin_loss(
        torch.ones(2, 3, device=d), torch.tensor([1, 1], device=d), weight=torch.ones(2, device=d)),
    "multi_margin_loss_empty_classes": lambda d: F.multi_margin_loss(
        torch.ones(2, 0, device=d), torch.tensor([1, 1], device=d)),
    # grid_sampler: ATen's checks in its order and words; empty batches and channels.
    "grid_sampler_2d_of_5d_batch_size": lambda d: torch.grid_sampler_2d(
        torch.ones(5, 5, 5, 5, 5, device=d), torch.zeros(1, 1, 1, 4, 4, device=d), 0, 0, True),
    "grid_sampler_batch_size": lambda d: torch.grid_sampler(
        torch.ones(5, 5, 5, 5, device=d), torch.zeros(1, 1, 4, 4, device=d), 0, 0, True),
    "grid_sampler_2d_grid_last_dim": lambda d: torch.grid_sampler_2d(
        torch.ones(2, 3, 5, 5, device=d), torch.zeros(2, 2, 2, 3, device=d), 0, 0, True),
    "grid_sampler_2d_rank": lambda d: torch.grid_sampler_2d(
        torch.ones(2, 3, 5, 5, device=d), torch.zeros(2, 2, 2, 2, 2, device=d), 0, 0, True),
    "grid_sampler_3d_bicubic": lambda d: torch.grid_sampler_3d(
        torch.ones(2, 3, 5, 5, 5, device=d), torch.zeros(2, 2, 2, 2, 3, device=d), 2, 0, True),
    "grid_sampler_empty_spatial": lambda d: torch.grid_sampler(
        torch.ones(2, 3, 0, 5, device=d), torch.zeros(2, 2, 2, 2, device=d), 0, 0, True),
    "grid_sampler_empty_batch": _pool_grad(
        lambda x: F.grid_sample(x, torch.zeros(0, 2, 2, 2, device=x.device), align_corners=True),
        (0, 3, 5, 5)),
    "grid_sample_input_grad_only": _pool_grad(
        lambda x: F.grid_sample(x, torch.linspace(-0.7, 0.8, 8, device=x.device).reshape(1, 2, 2, 2),
                                align_corners=True), (1, 2, 4, 5)),
    "grid_sampler_no_channels": lambda d: F.grid_sample(
        torch.ones(2, 0, 5, 5, device=d), torch.zeros(2, 2, 2, 2, device=d), align_corners=True),
    # embedding_bag: all bags empty in max mode (no index to gather), its dims checked first.
    "embedding_bag_max_all_empty": lambda d: _embedding_bag_grad(d, "max", [], [0, 0, 0]),
    "embedding_bag_max_some_empty": lambda d: _embedding_bag_grad(d, "max", [1, 3, 2], [0, 0, 2]),
    "embedding_bag_mean_all_empty": lambda d: _embedding_bag_grad(d, "mean", [], [0, 0]),
    "_embedding_bag_max_empty_bags": lambda d: torch._embedding_bag(
        torch.arange(10.0, device=d).reshape(5, 2), torch.tensor([1, 3, 2], device=d),
        torch.tensor([0, 1, 1], device=d), False, 2)[::3],
    "embedding_bag_5d_input": lambda d: torch.embedding_bag(
        torch.zeros(2, 6, device=d), torch.ones(2, 0, 0, 6, 6, dtype=torch.long, device=d),
        torch.zeros(2, 0, 0, 6, 6, dtype=torch.long, device=d)),
    "embedding_bag_2d_offsets": lambda d: torch._embedding_bag_forward_only(
        torch.zeros(2, 2, device=d), torch.ones(2, dtype=torch.long, device=d),
        torch.zeros(2, 3, dtype=torch.long, device=d)),
    "embedding_bag_3d_weight": lambda d: torch._embedding_bag(
        torch.zeros(2, 2, 2, device=d), torch.ones(2, dtype=torch.long, device=d),
        torch.zeros(2, dtype=torch.long, device=d)),
    "fractional_max_pool2d_empty_batch_backward": _pool_grad(
        lambda x: F.fractional_max_pool2d(x, 2, output_size=(3, 3), _random_samples=torch.rand(
            0, 4, 2, device=x.device)), (0, 4, 8, 8)),
}


def _embedding_bag_grad(d, mode, indices, offsets):
    bag = torch.nn.EmbeddingBag(5, 2, mode=mode).to(d)
    with torch.no_grad():
        bag.weight.copy_(torch.arange(10.0, device=d).reshape(5, 2))
    out = bag(torch.tensor(indices, dtype=torch.long, device=d), torch.tensor(offsets, device=d))
    (out * torch.arange(out.numel(), device=d).reshape(out.shape)).sum().backward()
    return out, bag.weight.grad


def _margin_grad(d, loss, x, target, reduction):
    x = x.to(d).requires_grad_()
    out = loss(x, target.to(d), reduction=reduction)
    out.sum().backward()
    return out, x.grad


def _unpool_empty_batch(d, pool, unpool, shape):
    x = torch.randn(shape, device=d, requires_grad=True)
    y, indices = pool(x, 2, stride=2, return_indices=True)
    u = unpool(y, indices, 2, stride=2)
    u.sum().backward()
    return u, x.grad



def _complex_2x2(d):
    return torch.tensor([[1 + 2j, -3 - 1j], [0j, 2j]], device=d)




def _fill_after_valid(d, fill, valid, invalid):
    t = torch.empty(4, device=d)
    fill(t, valid)
    return fill(t, invalid)



def _logcumsumexp_out(d, out, dim=-1, transposed=False):
    x = torch.randn(5, 2, generator=torch.Generator().manual_seed(0)).to(d)
    torch.logcumsumexp(x.t() if transposed else x, dim, out=out)
    return out



def _nll_uint8(d):
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0)).to(d).requires_grad_()
    target = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1], device=d, dtype=torch.uint8)
    loss = torch.nn.functional.nll_loss(torch.log_softmax(x, -1), target)
    loss.backward()
    return loss, x.grad


def _embedding_max_norm(d):
    torch.manual_seed(0)
    e = torch.nn.Embedding(6, 4, max_norm=1.0).to(d)
    return e(torch.tensor([1, 2, 2], device=d)), e.weight.detach().clone()


def _conv_grads(d, x_shape, w_shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(x_shape, generator=g).to(d).requires_grad_()
    w = torch.randn(w_shape, generator=g).to(d).requires_grad_()
    b = torch.randn(w_shape[0], generator=g).to(d).requires_grad_()
    conv = torch.nn.functional.conv1d if len(x_shape) == 3 else torch.nn.functional.conv2d
    y = conv(x, w, b)
    y.sum().backward()
    return y, x.grad, w.grad, b.grad


def _overlapping_source(d, op):
    y = torch.arange(6.0, device=d)
    return getattr(y, op)(0, torch.tensor([2, 1, 0], device=d), y[:3])


def _segment_max_grad(d):
    data = torch.tensor([1, float("nan"), 3, 4, 5, 5], device=d, requires_grad=True)
    out = torch._segment_reduce(data, "max", lengths=torch.tensor([1, 2, 3, 0], device=d), initial=0)
    out.sum().backward()
    return out, data.grad


@pytest.mark.parametrize("case", sorted(CASES))
def test_behaves_as_on_the_cpu(case):
    same_on_both(CASES[case])


@pytest.mark.parametrize("make", [
    lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2), device="tpu"),
    lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2)).to("tpu"),
    lambda: torch.ones(2, 2, device="tpu").to_sparse(),
    lambda: torch.ones(2, 2, device="tpu").to_sparse_csr(),
    lambda: torch.zeros((2, 2), layout=torch.sparse_coo, device="tpu"),
    lambda: torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2),
                                    (2, 2), device="tpu").to_dense(),
    lambda: torch.nn.Embedding(4, 2, sparse=True).to("tpu")(torch.tensor([1], device="tpu")).sum().backward(),
], ids=["coo", "coo_to", "to_sparse", "to_sparse_csr", "zeros_layout", "csr_to_dense", "embedding_sparse_grad"])
def test_sparse_layouts_raise_one_clear_error(make):
    """Sparse layouts are out of scope (docs/pytorch_test_suites.md): every entry point raises
    the same NotImplementedError, even with the CPU fallback on, and the device stays usable."""
    torch.tpu.enable_cpu_fallback = True
    try:
        with pytest.raises(NotImplementedError, match="Sparse tensors are not supported on the tpu device"):
            make()
    finally:
        torch.tpu.enable_cpu_fallback = False
    assert (torch.ones(2, device="tpu") + 1).cpu().tolist() == [2.0, 2.0]


def test_nested_tensors_raise_one_clear_error():
    x = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], device="tpu")
    with pytest.raises(NotImplementedError, match="Nested tensors are not supported on the tpu device"):
        x + 1


def test_transformer_encoder_nested_fast_path_says_how_to_avoid_it():
    with pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        _encoder_with_padding(nested=True)("tpu")


def test_storages_made_on_tpu_by_their_constructor():
    """torch.UntypedStorage(n, device="tpu") crashed the process (PyTorch's C++ allocation has no
    tpu allocator); deepcopy and clone of a storage make one."""
    import copy
    s = torch.UntypedStorage(8, device="tpu")
    assert (s.device.type, s.nbytes(), s.tolist()) == ("tpu", 8, [0] * 8)
    assert torch.UntypedStorage([1, 2, 3], device="tpu").tolist() == [1, 2, 3]
    a = torch.arange(4.0, device="tpu")
    q = [a, [a.storage()], a.view(2, 2)]
    w = copy.deepcopy(q)
    w[0].add_(1)  # the copy keeps its own sharing, apart from the original
    assert w[2].cpu().tolist() == [[1.0, 2.0], [3.0, 4.0]] and w[1][0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert a.untyped_storage().clone().device.type == "tpu"
    assert torch.UntypedStorage(4).device.type == "cpu"


def test_complex32_is_refused_with_a_runtime_error():
    """As PyTorch's kernels refuse a dtype they lack (RuntimeError): a TypeError would become
    Python's "unsupported operand type(s)" inside `tensor * 1j`."""
    h = torch.ones(2, dtype=torch.half, device="tpu")
    with pytest.raises(RuntimeError, match="dtype torch.complex32 is not supported on the tpu device"):
        h * 1j
    with pytest.raises(RuntimeError, match="complex32"):
        torch.complex(h, h)
