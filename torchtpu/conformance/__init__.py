"""Operator conformance against PyTorch's own OpInfo database.

Every OpInfo of `torch.testing._internal.common_methods_invocations.op_db`, every requested
dtype the op supports on the CPU and every sample of `op.sample_inputs("cpu", dtype)` runs on
`tpu` and on the CPU; results must agree in dtype, shape and value (`torch.testing.assert_close`
with its per-dtype default tolerances).  Mutated inputs are compared too.  Differentiable
samples of the gradient dtypes (float32 by default; complex64 and bfloat16 on request) also
compare gradients of a fixed random projection of the outputs with respect to every input that
requires grad, and `op.error_inputs` must raise the same exception type as on the CPU.

The measurement runs with `torch.tpu.enable_cpu_fallback = False`: an op without a lowering
reports `not_implemented`.  `fallback=True` additionally re-runs those samples with the CPU
fallback on and counts how many it would have rescued (they still count as not implemented).

API:  `run_op(opinfo, ...) -> dict`,  `select_ops(filters)`,  `summarize(results)`;
CLI:  `python -m torchtpu.conformance --help`.
"""
import contextlib
import dataclasses
import math
import signal
import time

import torch
from torch.utils._pytree import tree_flatten, tree_map

DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
    "complex64": torch.complex64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Ops whose values are random or uninitialised memory (PyTorch's own device comparison,
# TestCommon.test_compare_cpu, skips them too): only dtypes, shapes and devices are compared.
NONDETERMINISTIC = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "normal.number_mean", "normal.in_place", "uniform", "rand_like", "randn_like",
    "randint_like", "randint", "rand", "randn", "empty", "empty_like", "empty_strided", "empty_permuted",
    "new_empty", "new_empty_strided", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "svd_lowrank", "pca_lowrank", "torch._scaled_mm",
}

def _random_sample(name, sample):
    """Samples of otherwise deterministic ops that draw random numbers (attention with a
    dropout probability > 0 in training): the CPU's and the device's generators differ, so only
    dtypes, shapes and devices are compared, as for NONDETERMINISTIC ops."""
    p = sample.kwargs.get("dropout_p", 0.0)
    if name == "nn.functional.multi_head_attention_forward" and len(sample.args) > 9:
        p = sample.args[9]  # its dropout_p is positional
    return isinstance(p, float) and p > 0.0 and sample.kwargs.get("training", True)


# Ops whose indices PyTorch leaves unspecified among equal values (torch.sort's documentation:
# without stable=True "the order of equivalent elements is not guaranteed"; topk and kthvalue
# return any index of a tied value, and CUDA's differ from the CPU's). Their index outputs pass
# when they pick the same values as the CPU's, each slice a set of distinct positions.
TIE_ORDER_FREE = {"sort", "argsort", "topk", "kthvalue"}


def _index_dim(name, sample):
    """The dim along which `name`'s indices point, and whether the index outputs keep it."""
    args, kw = sample.args, sample.kwargs
    if name in ("sort", "argsort"):
        return (args[0] if args and isinstance(args[0], int) else kw.get("dim", -1)), True
    dim = args[1] if len(args) > 1 else kw.get("dim", -1)
    keepdim = True if name == "topk" else (args[2] if len(args) > 2 else kw.get("keepdim", False))
    return dim, keepdim


def _ties_only(name, sample, actual, expected):
    """Whether tpu's results differ from the CPU's only in which of several equal values an index
    points at (for ops in TIE_ORDER_FREE)."""
    if name not in TIE_ORDER_FREE or (name in ("sort", "argsort") and sample.kwargs.get("stable")):
        return False
    x = sample.input.detach()
    if x.dim() == 0:
        return False
    dim, keepdim = _index_dim(name, sample)
    a_idx, e_idx = (r if name == "argsort" else r[1] for r in (actual, expected))
    a_idx = a_idx.cpu()
    if not keepdim:
        a_idx, e_idx = a_idx.unsqueeze(dim), e_idx.unsqueeze(dim)
    if a_idx.dtype != e_idx.dtype or a_idx.shape != e_idx.shape:
        return False
    if bool(((a_idx < 0) | (a_idx >= max(x.shape[dim], 1))).any()):
        return False
    picked, wanted = x.gather(dim, a_idx), x.gather(dim, e_idx)
    if not torch.equal(picked, wanted) and not bool(
            ((picked == wanted) | (picked.isnan() & wanted.isnan())).all()):
        return False
    distinct = a_idx.sort(dim).values.diff(dim=dim)
    if not bool((distinct != 0).all()):
        return False
    if name != "argsort":  # the values themselves must agree exactly as before
        try:
            _compare(actual[0], expected[0], "output[0]")
        except Mismatch:
            return False
    return True


# Ops left out of the measurement on purpose, with the reason (listed in every report).
SKIPPED = {
}

OUR_NOT_IMPLEMENTED = "not implemented for the tpu device"


def _sync():
    torch.tpu.synchronize()


class SampleTimeout(Exception):
    pass


def full_name(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def load_op_db():
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def select_ops(filters=None, op_db=None):
    """OpInfos matching `filters` (names: exact `name` or `name.variant` match, else substring)."""
    op_db = load_op_db() if op_db is None else op_db
    if not filters:
        return list(op_db)
    chosen = []
    for f in filters:
        exact = [op for op in op_db if f in (op.name, full_name(op))]
        chosen += exact or [op for op in op_db if f in full_name(op)]
    seen, out = set(), []
    for op in chosen:
        if id(op) not in seen:
            seen.add(id(op))
            out.append(op)
    return out


# --- moving samples between devices ----------------------------------------------------------

def _replicate(t, device):
    """`t` on `device` with the same sizes, strides and storage offset (a fresh leaf)."""
    if t.layout != torch.strided:
        return t.detach().to(device)
    with torch.no_grad():
        if t.is_contiguous() or t.numel() == 0 or _is_dense(t):
            out = t.detach().to(device, copy=True)
            if out.stride() != t.stride() and t.numel() > 0:
                out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                out.copy_(t.detach())
        else:
            # A view with gaps or overlaps: copy the whole storage and take the same view.
            n = t.untyped_storage().nbytes() // t.element_size()
            flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,), (1,))
            out = flat.to(device, copy=True).as_strided(t.shape, t.stride(), t.storage_offset())
    out = out.detach()
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def _is_dense(t):
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d))
    expected = 1
    for d in reversed(dims):
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _to_device(tree, device):
    dev = torch.device(device)

    def move(x):
        if isinstance(x, torch.Tensor):
            return _replicate(x, dev)
        if isinstance(x, torch.device) and x.type == "cpu":
            return dev
        return x

    return tree_map(move, tree)


def _fix_device_kwargs(kwargs, device):
    out = dict(kwargs)
    for k in ("device",):
        v = out.get(k)
        if isinstance(v, str) and v.startswith("cpu"):
            out[k] = device
    return out


# Positional arguments an OpInfo creates on the CPU whatever the device under test (the op
# requires them there, e.g. tensor_split's tensor_indices_or_sections).
_HOST_ARGS = {"tensor_split": (0,)}


def _sample_parts(sample, device, name=None):
    inp, args, kwargs = _to_device((sample.input, sample.args, sample.kwargs), device)
    if device != "cpu":
        kwargs = _fix_device_kwargs(kwargs, device)
        host = _HOST_ARGS.get(name, ())
        args = tuple(_to_device(sample.args[i], "cpu") if i in host else a
                     for i, a in enumerate(args))
    return inp, args, kwargs


# --- comparison -------------------------------------------------------------------------------

class Mismatch(AssertionError):
    pass


def _short(msg, limit=240):
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


_LOOSE = {torch.float32: (1e-3, 1e-3), torch.complex64: (1e-3, 1e-3),
          torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-3)}


def _compare(actual, expected, what, values=True, loose=None, tensors_only=False):
    """Raise Mismatch unless the tpu result `actual` matches the CPU result `expected`.
    Appends to `loose` each result that matches only within PyTorch's device tolerance."""
    loose = [] if loose is None else loose
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if len(a_leaves) != len(e_leaves):
        raise Mismatch(f"{what}: {len(a_leaves)} results, expected {len(e_leaves)}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"{what}[{i}]" if len(e_leaves) > 1 else what
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{where}: got {type(a).__name__}, expected a tensor")
            if e.device.type == "cpu" and a.device.type not in ("tpu", "cpu"):
                raise Mismatch(f"{where}: on {a.device}")
            if a.dtype != e.dtype:
                raise Mismatch(f"{where}: dtype {a.dtype}, expected {e.dtype}")
            if tuple(a.shape) != tuple(e.shape):
                raise Mismatch(f"{where}: shape {tuple(a.shape)}, expected {tuple(e.shape)}")
            if not values or e.layout != torch.strided:
                continue
            a_cpu = a.detach().cpu()
            e_cpu = e.detach()
            if e_cpu.is_conj():
                e_cpu = e_cpu.resolve_conj()
            if e_cpu.is_neg():
                e_cpu = e_cpu.resolve_neg()
            try:
                torch.testing.assert_close(a_cpu, e_cpu, equal_nan=True, check_device=False,
                                           check_stride=False, check_layout=False)
            except AssertionError as exc:
                # PyTorch's own device-vs-CPU comparison (TestCommon.test_compare_cpu) allows
                # atol = rtol = 1e-3 (accumulation order differs between backends); such a
                # sample passes and is counted as `loose`.
                rtol, atol = _LOOSE.get(e_cpu.dtype, (0, 0))
                try:
                    if not rtol:
                        raise
                    torch.testing.assert_close(a_cpu, e_cpu, equal_nan=True, check_device=False,
                                               check_stride=False, check_layout=False,
                                               rtol=rtol, atol=atol)
                    loose.append(where)
                except AssertionError:
                    raise Mismatch(f"{where}: {_short(exc, 300)}") from None
        elif tensors_only:
            continue
        elif isinstance(e, float) and values:
            if not isinstance(a, (int, float)) or not (
                    math.isclose(a, e, rel_tol=1.3e-6, abs_tol=1e-5)
                    or (math.isnan(a) and math.isnan(e))):
                raise Mismatch(f"{where}: {a!r}, expected {e!r}")
        elif isinstance(e, (int, bool, str, torch.dtype, torch.Size, type(None))) and values:
            if a != e:
                raise Mismatch(f"{where}: {a!r}, expected {e!r}")


def _projection(outputs):
    """Tensors of `outputs` that carry a gradient."""
    return [o for o in tree_flatten(outputs)[0]
            if isinstance(o, torch.Tensor) and o.requires_grad
            and (o.dtype.is_floating_point or o.dtype.is_complex)]


def _weights(outs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]


def _grads(outputs, inputs, weights, device):
    outs = _projection(outputs)
    loss = None
    for o, w in zip(outs, weights):
        # The output's own device: an op may return CPU tensors from tpu inputs (`to("cpu")`).
        w = w.to(o.device if o.device.type in ("cpu", "tpu") else device)
        term = (o * w).sum()
        if term.is_complex():
            term = term.real
        loss = term if loss is None else loss + term
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _grad_inputs(parts):
    return [t for t in tree_flatten(parts)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]


# --- running one sample -------------------------------------------------------------------------

@dataclasses.dataclass
class SampleResult:
    forward: str          # pass | mismatch | error | not_implemented | cpu_error
    grad: str = None      # same statuses, None when the sample has no gradient to check
    message: str = ""
    grad_message: str = ""
    fallback: str = None  # with fallback=True, for not_implemented samples: pass | fail
    loose: bool = False   # passed only within PyTorch's device tolerance (1e-3)
    grad_loose: bool = False


def _classify_exc(exc):
    # Our fallback's error, or PyTorch's own for a backend hook it has no kernel for
    # (e.g. convolution_overrideable): either way an op the device does not implement.
    if isinstance(exc, NotImplementedError):
        return "not_implemented"
    if isinstance(exc, SampleTimeout):
        return "timeout"
    return "error"


def _exc_text(exc):
    return _short(f"{type(exc).__name__}: {exc}")


def run_sample(op, sample, *, grad=False, values=True, seed=0):
    """Run one SampleInput on the CPU and on tpu and compare (forward, and grads if `grad`)."""
    cpu_in, cpu_args, cpu_kwargs = _sample_parts(sample, "cpu")
    try:
        expected = op(cpu_in, *cpu_args, **cpu_kwargs)
        cpu_exc = None
    except Exception as exc:  # the CPU rejects the sample: tpu must raise the same type
        cpu_exc = exc
    tpu_in, tpu_args, tpu_kwargs = _sample_parts(sample, "tpu", full_name(op))
    try:
        actual = op(tpu_in, *tpu_args, **tpu_kwargs)
        _sync()  # a deferred (fused) op raises its error here at the latest
    except SampleTimeout:
        raise
    except Exception as exc:
        if cpu_exc is not None and isinstance(exc, type(cpu_exc)):
            return SampleResult("pass", message=f"both raise {type(cpu_exc).__name__}")
        status = _classify_exc(exc)
        res = SampleResult(status, message=_exc_text(exc))
        if grad and cpu_exc is None:
            res.grad, res.grad_message = status, "forward failed"
        return res
    if cpu_exc is not None:
        return SampleResult("mismatch", message=f"CPU raises {_exc_text(cpu_exc)}; tpu does not")
    post = sample.output_process_fn_grad
    try:
        expected_p = post(expected)
        actual_p = post(actual)
        loose = []
        try:
            _compare(actual_p, expected_p, "output", values, loose)
        except Mismatch:
            if not (values and _ties_only(full_name(op), sample, actual_p, expected_p)):
                raise
        # In-place ops and out= samples: the mutated arguments must agree too.
        _compare((tpu_in, tpu_args, tpu_kwargs), (cpu_in, cpu_args, cpu_kwargs), "input", values,
                 loose, tensors_only=True)
        res = SampleResult("pass", loose=bool(loose))
    except Mismatch as exc:
        res = SampleResult("mismatch", message=str(exc))
    except SampleTimeout:
        raise
    except Exception as exc:
        res = SampleResult(_classify_exc(exc), message=_exc_text(exc))
    if not grad:
        return res
    cpu_inputs = _grad_inputs((cpu_in, cpu_args, cpu_kwargs))
    outs = _projection(expected_p) if res.forward == "pass" else []
    if not cpu_inputs or not outs:
        return res
    if res.forward != "pass":
        res.grad, res.grad_message = res.forward, "forward failed"
        return res
    weights = _weights(outs, seed)
    try:
        g_cpu = _grads(expected_p, cpu_inputs, weights, "cpu")
        g_exc = None
    except Exception as exc:
        g_exc = exc
    try:
        g_tpu = _grads(actual_p, _grad_inputs((tpu_in, tpu_args, tpu_kwargs)), weights, "tpu")
        _sync()
    except SampleTimeout:
        raise
    except Exception as exc:
        if g_exc is not None and isinstance(exc, type(g_exc)):
            res.grad = "pass"
        else:
            res.grad, res.grad_message = _classify_exc(exc), _exc_text(exc)
        return res
    if g_exc is not None:
        res.grad, res.grad_message = "mismatch", f"CPU backward raises {_exc_text(g_exc)}; tpu does not"
        return res
    try:
        loose = []
        _compare(list(g_tpu), list(g_cpu), "grad", values, loose)
        res.grad = "pass"
        res.grad_loose = bool(loose)
    except Mismatch as exc:
        res.grad, res.grad_message = "mismatch", str(exc)
    except SampleTimeout:
        raise
    except Exception as exc:
        res.grad, res.grad_message = _classify_exc(exc), _exc_text(exc)
    return res


# --- running one op ---------------------------------------------------------------------------

def _alarm(seconds):
    if seconds and hasattr(signal, "SIGALRM"):
        def handler(signum, frame):
            raise SampleTimeout(f"sample took more than {seconds}s")
        signal.signal(signal.SIGALRM, handler)
        signal.alarm(int(seconds))


def _cancel_alarm(seconds):
    if seconds and hasattr(signal, "SIGALRM"):
        signal.alarm(0)


def _new_entry():
    return {"status": "pass", "samples": 0, "passed": 0, "loose": 0, "first_failure": "",
            "counts": {}}


_SEVERITY = ["pass", "not_implemented", "error", "timeout", "mismatch"]


def _record(entry, status, message, loose=False):
    entry["samples"] += 1
    entry["loose"] += bool(loose and status == "pass")
    entry["counts"][status] = entry["counts"].get(status, 0) + 1
    if status == "pass":
        entry["passed"] += 1
        return
    # The op's status is its worst sample's; its message the first sample failing that way.
    if _SEVERITY.index(status) > _SEVERITY.index(entry["status"]):
        entry["status"] = status
        entry["first_failure"] = message
    elif not entry["first_failure"]:
        entry["first_failure"] = message


def _finish(entry):
    if entry["samples"] == 0:
        entry["status"] = "no_samples"
    return entry


def _set_fallback(value):
    torch.tpu.enable_cpu_fallback = value


def run_op(op, dtypes=("float32",), *, max_samples=None, grad=True, errors=True,
           fail_fast=False, timeout=120, fallback=False, seed=0, grad_dtypes=("float32",),
           target=None):
    """Run every sample of `op` for each of `dtypes` (names); returns a JSON-able dict.
    Gradients are compared for the `grad_dtypes` among them that the op differentiates on the
    CPU: `result["grads"][dtype]`, and `result["grad"]` is float32's.  With `target` (a TPU
    topology name, e.g. "v5e:1x1") every program the samples build is also compiled for it:
    `result["target"][dtype]` counts them and the TPU compiler's errors, for the samples that
    pass on the CPU (see `_TargetCount`)."""
    import torchtpu  # noqa: F401
    name = full_name(op)
    result = {"op": name, "dtypes": {}, "grad": None, "grads": {}, "errors": None, "skipped": None,
              "nondeterministic": name in NONDETERMINISTIC, "fallback": None, "seconds": 0.0}
    if target is not None:
        result["target"] = {}
        result["target_name"] = target
    if name in SKIPPED:
        result["skipped"] = SKIPPED[name]
        return result
    _set_fallback(False)
    start = time.time()
    supported = op.supported_dtypes("cpu")
    values = name not in NONDETERMINISTIC
    fb = {"samples": 0, "passed": 0} if fallback else None
    for dname in dtypes:
        dtype = DTYPES[dname]
        if dtype not in supported:
            continue
        entry = _new_entry()
        result["dtypes"][dname] = entry
        want_grad = (grad and dname in grad_dtypes and op.supports_autograd
                     and dtype in op.supported_backward_dtypes("cpu"))
        gentry = _new_entry() if want_grad else None
        tcount = _TargetCount(target) if target is not None else None
        torch.manual_seed(seed)
        try:
            samples = op.sample_inputs("cpu", dtype, requires_grad=want_grad)
        except Exception as exc:
            _record(entry, "error", "sample_inputs failed: " + _exc_text(exc))
            continue
        k = 0
        while max_samples is None or k < max_samples:
            try:
                _alarm(timeout)
                try:
                    sample = next(samples)
                except StopIteration:
                    break
                except SampleTimeout:
                    raise
                except Exception as exc:
                    _record(entry, "error", "sample_inputs failed: " + _exc_text(exc))
                    break
                with tcount if tcount is not None else contextlib.nullcontext():
                    res = run_sample(op, sample, grad=want_grad,
                                     values=values and not _random_sample(name, sample), seed=seed + k)
                if tcount is not None:
                    tcount.add(k, res)
            except SampleTimeout as exc:
                res = SampleResult("timeout", message=str(exc))
                if want_grad:
                    res.grad, res.grad_message = "timeout", str(exc)
            finally:
                _cancel_alarm(timeout)
            k += 1
            _record(entry, res.forward, f"sample {k - 1}: {res.message}", res.loose)
            if gentry is not None and res.grad is not None:
                _record(gentry, res.grad, f"sample {k - 1}: {res.grad_message}", res.grad_loose)
            if fallback and "not_implemented" in (res.forward, res.grad):
                fb["samples"] += 1
                if _fallback_passes(op, sample, want_grad, values, seed + k - 1, timeout):
                    fb["passed"] += 1
            if fail_fast and (res.forward != "pass" or res.grad not in (None, "pass")):
                break
        _finish(entry)
        if gentry is not None and gentry["samples"]:
            result["grads"][dname] = gentry
        if tcount is not None:
            result["target"][dname] = tcount.entry
    result["grad"] = result["grads"].get("float32")
    if errors:
        result["errors"] = _run_error_inputs(op, timeout)
    result["fallback"] = fb
    result["seconds"] = round(time.time() - start, 2)
    assert not torch.tpu.enable_cpu_fallback
    return result


class _TargetCount:
    """The programs one (op, dtype)'s samples build, compiled for a TPU target as they are
    built (`torch.tpu.compile_for`).  Only samples that pass here count: a sample failing on
    the CPU is the CPU sweep's to report.  A program the TPU compiler aborts on kills the
    worker; the pool then reports the op as crashed."""

    def __init__(self, target):
        from .._core import tpu_compiler
        self._targeting = tpu_compiler.Targeting(target)
        self.entry = {"programs": 0, "failed": 0, "errors": []}

    def __enter__(self):
        self.reports = self._targeting.__enter__()
        return self

    def __exit__(self, *exc):
        self._targeting.__exit__(*exc)

    def add(self, k, res):
        reports, self.reports = self.reports, None
        if res.forward != "pass" or res.grad not in (None, "pass"):
            return
        for r in reports:
            self.entry["programs"] += 1
            if r.error:
                self.entry["failed"] += 1
                self.entry["errors"].append(f"sample {k}, {r.name}: {r.error[:300]}")


def _fallback_passes(op, sample, grad, values, seed, timeout):
    import warnings
    _set_fallback(True)
    try:
        _alarm(timeout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = run_sample(op, sample, grad=grad, values=values, seed=seed)
        return res.forward == "pass" and res.grad in (None, "pass")
    except Exception:
        return False
    finally:
        _cancel_alarm(timeout)
        _set_fallback(False)


def _run_error_inputs(op, timeout):
    if op.error_inputs_func is None:
        return None
    entry = _new_entry()
    try:
        error_inputs = list(op.error_inputs("cpu"))
    except Exception as exc:
        _record(entry, "error", "error_inputs failed: " + _exc_text(exc))
        return entry
    for k, ei in enumerate(error_inputs):
        s = ei.sample_input
        # Only error inputs the CPU itself rejects with the documented type are checked.
        try:
            cpu_in, cpu_args, cpu_kwargs = _sample_parts(s, "cpu")
            op(cpu_in, *cpu_args, **cpu_kwargs)
            continue
        except Exception as exc:
            if not isinstance(exc, ei.error_type):
                continue
            want = type(exc)
        try:
            _alarm(timeout)
            tpu_in, tpu_args, tpu_kwargs = _sample_parts(s, "tpu", full_name(op))
            op(tpu_in, *tpu_args, **tpu_kwargs)
            _sync()
            _record(entry, "mismatch", f"error input {k}: tpu raises nothing, CPU raises {want.__name__}")
        except SampleTimeout as exc:
            _record(entry, "timeout", f"error input {k}: {exc}")
        except Exception as exc:
            if isinstance(exc, want):
                _record(entry, "pass", "")
            else:
                _record(entry, "mismatch",
                        f"error input {k}: tpu raises {_exc_text(exc)}, CPU raises {want.__name__}")
        finally:
            _cancel_alarm(timeout)
    return _finish(entry) if entry["samples"] else None


# --- totals -------------------------------------------------------------------------------------

def summarize(results):
    """Pass rates: float32 forward (ops), float32 grads (ops), other dtypes ((op, dtype) pairs),
    error inputs (ops)."""
    def rate(entries):
        entries = list(entries)
        passed = sum(1 for e in entries if e["status"] == "pass")
        return {"passed": passed, "total": len(entries),
                "percent": round(100.0 * passed / len(entries), 1) if entries else None}

    measured = [r for r in results if not r["skipped"]]
    f32 = [r["dtypes"]["float32"] for r in measured
           if "float32" in r["dtypes"] and r["dtypes"]["float32"]["status"] != "no_samples"]
    grads = [r["grad"] for r in measured if r["grad"] is not None]
    other_grads = [e for r in measured for d, e in r.get("grads", {}).items() if d != "float32"]
    others = [e for r in measured for d, e in r["dtypes"].items()
              if d != "float32" and e["status"] != "no_samples"]
    errors = [r["errors"] for r in measured if r["errors"] is not None]
    samples = sum(e["samples"] for r in measured for e in r["dtypes"].values())
    totals = {
        "ops": len(results), "skipped": len(results) - len(measured), "samples": samples,
        "forward_float32": rate(f32), "grad_float32": rate(grads),
        "other_dtypes": rate(others), "error_inputs": rate(errors),
        "grad_other_dtypes": rate(other_grads),
        "per_dtype": {d: rate(r["dtypes"][d] for r in measured
                              if d in r["dtypes"] and r["dtypes"][d]["status"] != "no_samples")
                      for d in DTYPES},
        "status_counts": {},
        # ops passing only because some samples needed PyTorch's device tolerance (1e-3)
        "loose_forward_float32": sum(1 for e in f32 if e["status"] == "pass" and e["loose"]),
        "loose_grad_float32": sum(1 for e in grads if e["status"] == "pass" and e["loose"]),
    }
    for e in f32:
        totals["status_counts"][e["status"]] = totals["status_counts"].get(e["status"], 0) + 1
    fb = [r["fallback"] for r in measured if r.get("fallback")]
    if fb:
        totals["fallback"] = {"samples": sum(f["samples"] for f in fb),
                              "passed": sum(f["passed"] for f in fb)}
    return totals
