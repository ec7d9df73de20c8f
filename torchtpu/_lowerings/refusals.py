"""Dtypes the CPU kernels have no code for, and other checks of theirs that decomposed
lowerings' meta kernels lack.

PyTorch's meta kernels accept them (and JAX would compute something), so each op names the
kinds of (promoted) dtype its CPU kernel refuses, with the CPU's exception type.  Applied once
the table is full, to hand-written and decomposed lowerings alike."""
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .._core.registry import TABLE, overload_of
from .meta import dtype_name


def _kind(dtype):
    return "bool" if dtype == torch.bool else "complex" if dtype.is_complex else \
        "float" if dtype.is_floating_point else "int"


def _meta_error(name, args):
    """The IndexError (a dim out of range) PyTorch's meta kernel of `name` raises for `args`,
    else None: the CPU kernels wrap their dims before they dispatch on the dtype.  (Other meta
    errors are left alone: some Python meta kernels check what the CPU kernel checks later.)"""
    overload = overload_of(name)
    schema = [a for a in overload._schema.arguments if not a.is_out]
    pos, kw = [], {}
    for a, v in zip(schema, args):
        if isinstance(v, torch.Tensor):
            v = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        if a.kwarg_only:
            kw[a.name] = v
        else:
            pos.append(v)
    try:
        overload(*pos, **kw)
    except Exception as e:  # noqa: BLE001 - only its IndexError is the CPU's
        return e if isinstance(e, IndexError) else None
    return None


def _refusing(previous, name, kinds, arity, exc, empty, kernel=None):
    def validate(*args):
        if previous is not None:
            previous(*args)
        operands = [a for a in args[:arity] if isinstance(a, (torch.Tensor, bool, int, float, complex))]
        if not any(isinstance(a, torch.Tensor) for a in operands):
            return
        if not empty and operands[0].numel() == 0:
            return
        dtype = operands[0].dtype if len(operands) == 1 else elementwise_dtypes(
            *operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
        if _kind(dtype) in kinds or dtype in kinds:
            op = kernel or name.split("::")[1].split(".")[0]
            raise _meta_error(name, args) or exc(f'"{op}" not implemented for \'{dtype_name(dtype)}\'')
    return validate


def _lowering(name):
    """The table's lowering of `name`, or None where this torch release (or its
    decompositions) gives the table none: a refusal of an op we do not run is moot."""
    op = overload_of(name, missing_ok=True)
    return None if op is None else TABLE.get(op)


def _also(name, check):
    """Run `check` after the lowering's own validate (and refusals)."""
    low = _lowering(name)
    if low is None:
        return
    previous = low.validate

    def validate(*args):
        if previous is not None:
            previous(*args)
        check(*args)
    low.validate = validate


def refuse(kinds, *names, arity=1, exc=NotImplementedError, empty=True, kernel=None):
    """The lowerings of `names` (aten overloads) refuse `kinds` of dtype ("bool", "int",
    "float", "complex", or a torch dtype), as the CPU does, after its shape checks;
    `arity` leading arguments decide the dtype (promoted together); empty=False: a kernel that
    returns before looking at the dtype when its input is empty; `kernel`: the name the CPU's
    message gives (the op's by default)."""
    lowerings = {id(low): (low, n) for n in names if (low := _lowering(n)) is not None}
    for low, name in lowerings.values():
        low.validate = _refusing(low.validate, name, kinds, arity, exc, empty, kernel)


refuse(("bool",), "aten::abs.default", "aten::floor.default", "aten::ceil.default",
       "aten::trunc.default")
refuse(("bool", "complex"), "aten::round.default")
refuse(("bool", "int"), "aten::frac.default")
refuse(("complex",), "aten::sign.default", "aten::digamma.default", "aten::signbit.default")
refuse(("bool", "complex"), "aten::floor_divide.default", "aten::floor_divide.Scalar",
       "aten::remainder.Tensor", "aten::remainder.Scalar", arity=2)
refuse(("bool",), "aten::fmod.Tensor", "aten::fmod.Scalar", "aten::pow.Tensor_Tensor", arity=2)
refuse(("complex",), "aten::atan2.default", "aten::xlogy.Tensor", "aten::lt.Tensor",
       "aten::lt.Scalar", "aten::le.Tensor", "aten::le.Scalar", "aten::gt.Tensor",
        "aten::gt.Scalar", "aten::ge.Tensor", "aten::ge.Scalar", arity=2)
refuse(("complex",), "aten::heaviside.default", "aten::fmax.default", "aten::fmin.default",
       arity=2, exc=RuntimeError)
refuse(("bool", "int", "complex"), "aten::hypot.default", arity=2)
for _direction in ("left", "right"):  # the CPU kernels' names: lshift_cpu, rshift_cpu
    _op = _direction[0] + "shift"
    refuse(("bool", "float", "complex"), f"aten::bitwise_{_direction}_shift.Tensor",
           f"aten::bitwise_{_direction}_shift.Tensor_Scalar", f"aten::__{_op}__.Tensor",
           f"aten::__{_op}__.Scalar", f"aten::__i{_op}__.Tensor", f"aten::__i{_op}__.Scalar",
           arity=2, kernel=f"{_op}_cpu")
refuse(("bool", "int"), "aten::lerp.Scalar", "aten::lerp.Tensor")
refuse(("complex",), "aten::clamp.default", "aten::clamp.Tensor", "aten::clamp_min.default",
       "aten::clamp_min.Tensor", "aten::clamp_max.default", "aten::clamp_max.Tensor")
refuse(("complex",), "aten::max.default", "aten::max.dim", "aten::min.default", "aten::min.dim",
       "aten::amax.default", "aten::amin.default", "aten::aminmax.default", "aten::median.default",
       "aten::median.dim", "aten::nanmedian.default", "aten::nanmedian.dim",
       "aten::cummax.default", "aten::kthvalue.default")
refuse(("bool", "complex"), "aten::argmax.default", "aten::argmin.default", exc=RuntimeError)
refuse(("complex",), "aten::sort.default", "aten::sort.stable", "aten::topk.default",
       "aten::nansum.default", exc=RuntimeError)
refuse(("bool",), "aten::convolution.default")
refuse(("bool", "int", "complex"), "aten::_softmax.default", "aten::_log_softmax.default",
       empty=False)
refuse(("bool", "int", "complex"), "aten::igamma.default", "aten::igammac.default", arity=2)

for _name in ("amax.default", "amin.default", "heaviside.default", "neg.default", "round.default", "round.decimals", "bitwise_not.default", "frac.default",
              "nan_to_num.default"):
    if (_low := _lowering("aten::" + _name)) is not None:
        _low.exact_out = True
for _name in ("complex.default", "polar.default"):  # no cast: complex's kernel says so
    if (_low := _lowering("aten::" + _name)) is not None:
        _low.exact_out = "Expected object of scalar type {expected} but got scalar type {got} for argument 'out'"
for _name, _message in {
        # The CPU's kernels write no other dtype than the result's; their words for it.
        "max.dim": "Expected out tensor to have dtype {expected_c}, but got {got_c} instead",
        "min.dim": "Expected out tensor to have dtype {expected_c}, but got {got_c} instead",
        "amax.default": "Expected the dtype for input and out to match, but got {expected} for "
                        "input's dtype and {got} for out's dtype.",
        "amin.default": "Expected the dtype for input and out to match, but got {expected} for "
                        "input's dtype and {got} for out's dtype.",
        "mode.default": "expected scalar type '{expected}' but got '{got}' for {name} output",
        "isposinf.default": "isposinf does not support non-boolean outputs.",
        "isneginf.default": "isneginf does not support non-boolean outputs.",
        "frexp.Tensor": {
            "mantissa": "torch.frexp() expects mantissa to have dtype {expected_c} but got {got_c}",
            "exponent": "torch.frexp() expects exponent to have int dtype but got {got_c}"}}.items():
    if (_low := _lowering("aten::" + _name)) is not None:
        _low.exact_out = _message


def _check_repeated_dims(x, dim=None, *rest):
    # ATen's make_dim_mask, after wrapping (PyTorch's Python reference words it differently).
    if isinstance(dim, (list, tuple)) and isinstance(x, torch.Tensor):
        seen = set()
        for d in dim:
            w = d % max(x.dim(), 1) if -max(x.dim(), 1) <= d < max(x.dim(), 1) else d
            if w in seen:
                raise RuntimeError(f"dim {w} appears multiple times in the list of dims")
            seen.add(w)


for _name in ("sum.dim_IntList", "mean.dim", "amax.default", "amin.default", "nansum.default",
              "var.correction", "std.correction", "var_mean.correction", "std_mean.correction",
              "logsumexp.default", "any.dims", "all.dims", "count_nonzero.dim_IntList"):
    _also("aten::" + _name, _check_repeated_dims)
for _name in ("linalg_vector_norm.default", "norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype"):
    _also("aten::" + _name, lambda x, ord=2, dim=None, *rest: _check_repeated_dims(x, dim))


def _check_kthvalue(x, k, dim=-1, keepdim=False):
    if x.dim() > 0 and -x.dim() <= dim < x.dim() and x.shape[dim] == 0:
        raise IndexError(f"kthvalue(): Expected reduction dim {dim % x.dim()} to have non-zero size.")


_also("aten::kthvalue.default", _check_kthvalue)
for _name in ("all.default", "all.dim", "all.dims", "any.default", "any.dim", "any.dims"):
    if (_low := _lowering("aten::" + _name)) is not None:
        _low.bool_out = True
refuse(("bool",), "aten::addcmul.default", arity=3)
refuse(("bool", "int"), "aten::uniform_.default", "aten::normal_.default")
refuse(("bool", "int"), "aten::_adaptive_avg_pool2d.default", "aten::_adaptive_avg_pool3d.default")
refuse(("bool", "int"), "aten::var.correction", "aten::std.correction", "aten::var_mean.correction",
       "aten::std_mean.correction", exc=RuntimeError)
refuse(("bool", "complex", torch.uint8, torch.int8, torch.int16, torch.int32),
       "aten::avg_pool2d.default", "aten::avg_pool3d.default")
refuse(("bool", "int", "complex"), "aten::huber_loss.default", arity=2)
refuse(("complex",), "aten::copysign.Tensor", "aten::copysign.Scalar", arity=2)


def _check_max_pool2d(x, *rest):
    # The CPU checks the rank before anything else (the Python meta kernel wraps dims first).
    if x.dim() not in (3, 4):
        raise RuntimeError("non-empty 3D or 4D (batch mode) tensor expected for input")


_also("aten::max_pool2d_with_indices.default", _check_max_pool2d)
refuse(("bool",), "aten::max_pool2d_with_indices.default", "aten::dot.default")
refuse(("bool", "int"), "aten::mse_loss.default", arity=2)
refuse(("bool", "int", "complex"), "aten::binary_cross_entropy.default", arity=2)
refuse(("bool", torch.int8, torch.int16, torch.int32, torch.int64),
       *(f"aten::{op}.{ov}" for op in ("upsample_nearest1d", "upsample_nearest2d",
                                       "upsample_nearest3d", "_upsample_nearest_exact1d",
                                       "_upsample_nearest_exact2d", "_upsample_nearest_exact3d")
         for ov in ("default", "vec")))
refuse(("complex",), "aten::log_sigmoid_forward.default", "aten::log_sigmoid.default")


def _check_nansum_dtype(x, dim=None, keepdim=False, dtype=None, *rest):
    if dtype is not None and dtype.is_complex:  # (complex input: refused above)
        raise NotImplementedError(f'"nansum_cpu" not implemented for \'{dtype_name(dtype)}\'')


_also("aten::nansum.default", _check_nansum_dtype)


# The backward of an in-place elu_/celu_/leaky_relu_ reads the forward's result in place of
# its input, which a negative slope cannot invert: the CPU refuses rather than guess.
_INPLACE_SLOPE = ("In-place {} backward calculation is triggered with a negative slope which is "
                  "not supported. This is caused by calling in-place forward function with a "
                  "negative slope, please call out-of-place version instead.")


def _check_elu_backward(grad, alpha, scale, input_scale, is_result, *rest):
    if is_result and alpha < 0:
        raise RuntimeError(_INPLACE_SLOPE.format("elu"))


def _check_leaky_relu_backward(grad, x, negative_slope, self_is_result):
    if self_is_result and negative_slope < 0:
        raise RuntimeError(_INPLACE_SLOPE.format("leakyReLu") + " File an issue at "
                           "https://github.com/pytorch/pytorch if you do require supporting "
                           "in-place leakRelu backward calculation with negative slope")


_also("aten::elu_backward.default", _check_elu_backward)
_also("aten::leaky_relu_backward.default", _check_leaky_relu_backward)
