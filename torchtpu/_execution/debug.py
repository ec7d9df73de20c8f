"""Pointing errors at the user's code: the op, its inputs and the line that called it."""
import os
import sys

import jax
import jax.numpy as jnp
import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_internal_files = {}


def _is_internal(filename):
    internal = _internal_files.get(filename)
    if internal is None:
        internal = _internal_files[filename] = (
            filename.startswith((_TORCH_DIR, _OWN_DIR)) or filename.startswith("<"))
    return internal


def user_frame(depth=2):
    """(filename, line, function) of the innermost caller outside torch and torchtpu, or None
    (e.g. for ops run by the autograd engine's own thread)."""
    return _resolved(user_site(depth + 1))


def user_site(depth=2):
    """`user_frame`'s caller as (code, offset of its current instruction), or None: fused eager
    notes one per op, so the walk is inlined (a dict lookup per frame, no call), and the line
    number, which Python decodes from the code's line table on each read (~0.1 us, more in a
    long function), is looked up only when an error names it (`format_where`)."""
    try:
        f = sys._getframe(depth)
    except ValueError:  # no frame that deep: the callers' own frames are all there is
        return None
    known = _internal_files
    while f is not None:
        code = f.f_code
        internal = known.get(code.co_filename)
        if internal is None:
            internal = _is_internal(code.co_filename)
        if not internal:
            return code, f.f_lasti
        f = f.f_back
    return None


def _resolved(where):
    """(filename, line, function) of a `user_site` (a `user_frame` is returned as it is)."""
    if where is None or len(where) == 3:
        return where
    code, offset = where
    line = next((n for start, end, n in code.co_lines() if start <= offset < end and n), None)
    return code.co_filename, line or code.co_firstlineno, code.co_name


def format_where(where):
    """A `user_frame` or `user_site` as the line it names."""
    if where is None:
        return "outside user code (e.g. in the autograd engine)"
    filename, line, function = _resolved(where)
    return f"{filename}:{line} in {function}"


def describe_inputs(vals):
    parts = []
    for v in vals:
        if isinstance(v, torch.Tensor):
            parts.append(f"Tensor{list(v.shape)} {str(v.dtype).replace('torch.', '')} on {v.device}")
        elif isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
            parts.append("[" + ", ".join(describe_inputs(v)) + "]")
        else:
            parts.append(repr(v))
    return ", ".join(parts)


def describe_key(key):
    """The tensor inputs recorded in an op's cache key, for ops whose tensors are gone."""
    return ", ".join(f"Tensor{list(k[1])} {str(k[0]).replace('torch.', '')}" for k in key
                     if isinstance(k, tuple) and len(k) in (5, 7) and isinstance(k[0], torch.dtype))


def attributed(error, op_name, inputs, where, note=""):
    """`error` again, as the same exception type when possible, naming the op and the line."""
    message = (f"{error}\n  [torchtpu] raised by {op_name}({inputs})\n"
               f"  called from {format_where(where)}{note}")
    try:
        new = type(error)(message)
    except Exception:
        new = RuntimeError(message)
    return new


def failed_check(values, compiled, op_name, where, note):
    """The error of an op's first failed device-side check (`values`: its checks read on the
    host), naming the op and the line; None when they all passed."""
    error = compiled.check_error(values)
    if error is None:
        return None
    return attributed(error, op_name, describe_key(compiled.key), where,
                      note=f"\n  ({note}; a device-side check, read when the host next waited)")


def first_non_finite(arrays):
    """Index of the first floating/complex array holding NaN or Inf, or None (synchronises)."""
    for i, a in enumerate(arrays):
        if jnp.issubdtype(a.dtype, jnp.inexact) and not bool(jax.device_get(jnp.isfinite(a).all())):
            return i
    return None
