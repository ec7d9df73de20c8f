"""PyTorch's own device-generic test suites, run on tpu and compared with their CPU twins.

PyTorch writes most of its operator tests once and instantiates them for every device with
`instantiate_device_type_tests`: a PrivateUse1 backend gets its own generated class (for
`TestShapeOps`, `TestShapeOpsPRIVATEUSE1`, whose tests are named `..._tpu[_dtype]`), built from
`PrivateUse1TestBase` in `torch/testing/_internal/common_device_type.py` once torchtpu has named
the backend. These test files are not in torch's wheel: `path` is a PyTorch source checkout
(its `test/` folder), ideally of the installed release (docs/op_coverage.md says how to get one).

Each suite runs in a worker process of its own (`python -m torchtpu.conformance.pytorch_suites
worker ...`, strict mode, CPU fallback off) that reports every test on a pipe; the parent kills
a worker whose test outlives the per-test timeout, or notices one that died, records that test
as crashed and starts a fresh worker on the rest. Every tpu test that does not pass then has its
CPU twin (the same test of the generated CPU class) run the same way, which splits the failures
into "failed on tpu only" (ours to fix) and "failed on both" (the test or the checkout's version).

API: `run_suites(path, ...) -> list of per-suite dicts`; CLI: `python -m torchtpu.conformance
--pytorch-tests PATH` (see __main__.py).
"""
import dataclasses
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time

from .pool import Progress

_DTYPE_NAMES = {
    "float32", "float64", "float16", "bfloat16", "complex32", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits8", "bits16",
}


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    files: tuple            # candidates under test/, the first that exists is used
    classes: tuple = ()     # generic test classes; () = every device-generic class of the file
    float32_only: bool = False  # keep tests without a dtype or with float32 among theirs


SUITES = (
    Suite("TestBinaryUfuncs", ("test_binary_ufuncs.py",), ("TestBinaryUfuncs",)),
    Suite("TestUnaryUfuncs", ("test_unary_ufuncs.py",), ("TestUnaryUfuncs",)),
    Suite("TestReductions", ("test_reductions.py",), ("TestReductions",)),
    Suite("TestShapeOps", ("test_shape_ops.py",), ("TestShapeOps",)),
    Suite("TestTensorCreation", ("test_tensor_creation_ops.py",), ("TestTensorCreation",)),
    Suite("TestRandomTensorCreation", ("test_tensor_creation_ops.py",),
          ("TestRandomTensorCreation", "TestLikeTensorCreation", "TestAsArray")),
    Suite("TestTypePromotion", ("test_type_promotion.py",), ("TestTypePromotion",)),
    Suite("TestNNDeviceType", ("test_nn.py",), ("TestNNDeviceType",), float32_only=True),
    Suite("TestAutogradDeviceType", ("test_autograd.py", "autograd/test_device_type.py"),
          ("TestAutogradDeviceType",)),
    Suite("test_torch", ("test_torch.py",), (), float32_only=True),
    Suite("test_foreach", ("test_foreach.py",), (), float32_only=True),
    Suite("test_linalg", ("test_linalg.py",), (), float32_only=True),
    Suite("TestSortAndSelect", ("test_sort_and_select.py",)),
    Suite("TestScatterGather", ("test_scatter_gather_ops.py",)),
    Suite("TestSegmentReductions", ("test_segment_reductions.py",)),
    Suite("test_spectral_ops", ("test_spectral_ops.py",)),
    Suite("test_masked", ("test_masked.py",)),
    Suite("TestComplexTensor", ("test_complex.py",)),
    Suite("test_transformers", ("test_transformers.py",)),
    Suite("TestMHADeviceType", ("test_native_mha.py",)),
    Suite("test_serialization", ("test_serialization.py",)),
    Suite("TestTorchDlPack", ("test_dlpack.py",)),
    Suite("TestNumPyInterop", ("test_numpy_interop.py",)),
    Suite("nn.test_convolution", ("nn/test_convolution.py",), float32_only=True),
    Suite("nn.test_pooling", ("nn/test_pooling.py",), float32_only=True),
    Suite("nn.test_embedding", ("nn/test_embedding.py",), float32_only=True),
    Suite("nn.test_dropout", ("nn/test_dropout.py",)),
    Suite("nn.test_multihead_attention", ("nn/test_multihead_attention.py",)),
    Suite("test_modules", ("test_modules.py",), float32_only=True),
    Suite("test_module_init", ("test_module_init.py",), float32_only=True),
    Suite("test_ops", ("test_ops.py",), float32_only=True),
    Suite("test_ops_gradients", ("test_ops_gradients.py",), float32_only=True),
    Suite("test_ops_fwd_gradients", ("test_ops_fwd_gradients.py",), float32_only=True),
)

PASSED, FAILED, SKIPPED, CRASHED = "passed", "failed", "skipped", "crashed"

# Features torchtpu does not have, on purpose (docs/pytorch_test_suites.md says why and what
# each would take): a tpu-only failure whose message names one counts as "excluded".
EXCLUSIONS = {
    "quantized": re.compile(r"quantize_per|quantized|[^a-z]q(u)?int\d|Quantized", re.I),
    "sparse": re.compile(r"sparse", re.I),
    "complex32": re.compile(r"complex32|ComplexHalf|chalf"),
    "dlpack": re.compile(r"dlpack", re.I),
    "nested": re.compile(r"[Nn]ested tensor|NestedTensor"),
    # test_conv_backend asserts the convolution kernel ATen picks for the device: a PrivateUse1
    # device gets convolution_overrideable (_ConvBackend.Overrideable) by PyTorch's design.
    "conv backend": re.compile(r"_ConvBackend\.Overrideable"),
}


# Tests whose failure is an excluded feature that their message does not name.
EXCLUDED_TESTS = {
    # `complex scalar + float16 tensor` is complex32: the test then expects promote_types to
    # refuse it as well.
    re.compile(r"\.test_result_type_tpu_(complex\d+_float16|float16_complex\d+)$"): "complex32",
    # one_hot of invalid classes raises at the next wait, as CUDA's device assert does (which
    # the test exempts by name): reading the classes on the host would wait at every call.
    re.compile(r"TestNNDeviceType\w*\.test_one_hot_tpu$"): "deferred check",
    re.compile(r"\.test_embedding_bag_out_of_bounds_idx_"): "deferred check",
}


def excluded(message, test_id=""):
    """The exclusion a failure falls under, or None. The dispatcher's "Could not run ..."
    message goes on to list every backend the op has (SparseCPU...): only its head counts."""
    head = (message or "").split("This could be because")[0]
    return next((k for k, pattern in EXCLUSIONS.items() if pattern.search(head)), None) or \
        next((k for pattern, k in EXCLUDED_TESTS.items() if pattern.search(test_id)), None)


DEVICE = "tpu"  # torch._C._get_privateuse1_backend_name() once torchtpu is imported
_SUFFIXES = ("PRIVATEUSE1", DEVICE.upper())
_WORKER_BATCH = 400  # tests per worker process: bounds the memory of cached executables
_STARTUP_S = 600     # importing torch, torchtpu and a large test file, before the first test


def test_dir(path):
    """The folder holding PyTorch's test files: `path` itself or `path/test`."""
    for d in (os.path.join(path, "test"), path):
        if os.path.isfile(os.path.join(d, "test_torch.py")) or os.path.isfile(
                os.path.join(d, "test_shape_ops.py")):
            return os.path.abspath(d)
    raise FileNotFoundError(f"{path!r} is not a PyTorch source checkout (no test/test_torch.py)")


def suite_file(tests, suite):
    for f in suite.files:
        if os.path.isfile(os.path.join(tests, f)):
            return f
    return None


def keep_test(name, float32_only):
    """Whether a generated tpu test `name` (`test_x_tpu[_dtype...]`) is in the slice."""
    if not float32_only:
        return True
    head, sep, tail = name.rpartition(f"_{DEVICE}")
    if not sep:
        return True
    dtypes = [t for t in tail.split("_") if t in _DTYPE_NAMES]
    return not dtypes or "float32" in dtypes


def cpu_twin(test_id):
    """`TestFooPRIVATEUSE1.test_x_tpu_float32` (or `TestFooTPU...`) -> `TestFooCPU.test_x_cpu_float32`."""
    cls, _, name = test_id.partition(".")
    cls = (_generic_name(cls) or cls[:-3]) + "CPU"
    i = name.rfind(f"_{DEVICE}")
    while i >= 0 and not (i + len(DEVICE) + 1 == len(name) or name[i + len(DEVICE) + 1] == "_"):
        i = name.rfind(f"_{DEVICE}", 0, i)
    if i >= 0:
        name = name[:i] + "_cpu" + name[i + len(DEVICE) + 1:]
    return f"{cls}.{name}"


# --- the parent: one worker process at a time per suite, with a watchdog ---------------------

class _Worker:
    def __init__(self, tests, file, classes, mode, names, log):
        cmd = [sys.executable, "-m", "torchtpu.conformance.pytorch_suites", "worker", tests, file,
               mode, ",".join(classes)]
        env = dict(os.environ, PYTORCH_PRINT_REPRO_ON_FAILURE="0",
                   PYTORCH_TESTING_DEVICE_ONLY_FOR="cpu,privateuse1")
        self.log = log
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=logf, env=env, start_new_session=True)
        self.proc.stdin.write(json.dumps(names).encode())
        self.proc.stdin.close()
        self._buf = b""

    def next_message(self, timeout):
        """The worker's next JSON message, None when it exited, "timeout" past `timeout` s."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return "timeout"
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self):
        try:
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def why_dead(self):
        rc = self.proc.wait()
        tail = _tail(self.log)
        return f"the worker process died (exit {rc})" + (f": {tail}" if tail else "")


def _tail(path, lines=3):
    try:
        with open(path, errors="replace") as f:
            text = [ln.strip() for ln in f.read()[-4000:].splitlines() if ln.strip()]
        return " | ".join(text[-lines:])[-400:]
    except OSError:
        return ""


def _run_tests(tests, file, classes, ids, timeout, log, on_result=None):
    """Runs `ids` (Class.test) in workers; a test that hangs or kills its worker is CRASHED."""
    results, remaining = {}, list(ids)
    while remaining:
        batch = remaining[:_WORKER_BATCH]
        worker = _Worker(tests, file, classes, "run", batch, log)
        current, started = None, False
        try:
            while True:
                msg = worker.next_message(timeout if started else _STARTUP_S)
                if msg == "timeout":
                    worker.kill()
                    what = current or batch[0]
                    why = (f"timed out after {timeout}s" if started
                           else f"the worker did not start within {_STARTUP_S}s")
                    results[what] = {"status": CRASHED, "message": why, "seconds": timeout}
                    break
                if msg is None:
                    why = worker.why_dead()
                    if current is not None:
                        results[current] = {"status": CRASHED, "message": why, "seconds": 0.0}
                    elif not started:  # the file did not import: nothing in it can run
                        for t in remaining:
                            results[t] = {"status": CRASHED, "message": why, "seconds": 0.0}
                    break
                started = True
                if "start" in msg:
                    current = msg["start"]
                    continue
                results[msg["test"]] = {k: msg[k] for k in ("status", "message", "seconds")}
                if on_result:
                    on_result(msg["test"], msg["status"])
                current = None
        finally:
            if worker.proc.poll() is None:
                worker.kill()
        remaining = [t for t in remaining if t not in results]
    return results


def _list_tests(tests, file, classes, log):
    worker = _Worker(tests, file, classes, "list", [], log)
    try:
        msg = worker.next_message(_STARTUP_S)
        if msg is None:
            raise RuntimeError(worker.why_dead())
        if msg == "timeout":
            raise RuntimeError(f"listing the tests took more than {_STARTUP_S}s")
        return msg["tests"]
    finally:
        if worker.proc.poll() is None:
            worker.kill()


def run_suite(tests, suite, *, timeout=300, pattern=None, all_dtypes=False, opinfo_tests=False,
              log_dir=None, progress=True):
    """Runs one suite's tpu tests, then the CPU twins of those that did not pass."""
    start = time.time()
    out = {"suite": suite.name, "file": None, "counts": dict.fromkeys(
        ("ran", PASSED, "failed_tpu_only", "failed_both", SKIPPED, CRASHED), 0),
        "tests": {}, "error": None, "seconds": 0.0}
    out["counts"]["excluded"] = 0
    file = suite_file(tests, suite)
    if file is None:
        out["error"] = f"none of {', '.join(suite.files)} in {tests}"
        return out
    out["file"] = file
    log = os.path.join(log_dir or tempfile.gettempdir(), f"torchtpu-{suite.name}.log")
    open(log, "w").close()
    try:
        ids = _list_tests(tests, file, suite.classes, log)
    except RuntimeError as exc:
        out["error"] = str(exc)
        return out
    # OpInfo-parametrized tests: only with opinfo_tests (the OpInfo sweep runs those ops' samples),
    # in float32 unless all_dtypes.
    ids = [t for t, opinfo in ids
           if (opinfo_tests or all_dtypes or not opinfo)
           and keep_test(t.partition(".")[2], (suite.float32_only or opinfo) and not all_dtypes)]
    if pattern:
        ids = [t for t in ids if re.search(pattern, t)]
    bar = Progress(len(ids), enabled=progress)
    tpu = _run_tests(tests, file, suite.classes, ids, timeout, log,
                     lambda test, status: bar.update(f"{suite.name} {test.partition('.')[2]}", status))
    twins = {t: cpu_twin(t) for t in ids if tpu[t]["status"] in (FAILED, CRASHED)}
    cpu = _run_tests(tests, file, suite.classes, list(twins.values()), timeout, log) if twins else {}
    c = out["counts"]
    for t in ids:
        r = dict(tpu[t])
        c["ran"] += 1
        if t in twins:
            r["cpu"] = cpu.get(twins[t], {"status": "missing", "message": "no CPU twin"})
        kind = r["status"]
        if kind == FAILED:
            kind = "failed_both" if r["cpu"]["status"] in (FAILED, CRASHED) else "failed_tpu_only"
        reason = excluded(r["message"], t) if kind == "failed_tpu_only" else None
        if reason:
            kind, r["excluded"] = "excluded", reason
        c[kind] += 1
        r["kind"] = kind
        out["tests"][t] = r
    out["seconds"] = round(time.time() - start, 1)
    return out


def select_suites(names):
    if not names:
        return list(SUITES)
    known = {s.name.lower(): s for s in SUITES}
    chosen = []
    for n in names:
        s = known.get(n.lower())
        if s is None:
            raise ValueError(f"unknown suite {n!r}; choose among {', '.join(s.name for s in SUITES)}")
        chosen.append(s)
    return chosen


def run_suites(path, suites=None, *, timeout=300, pattern=None, all_dtypes=False,
               opinfo_tests=False, progress=True, log_dir=None):
    tests = test_dir(path)
    return [run_suite(tests, s, timeout=timeout, pattern=pattern, all_dtypes=all_dtypes,
                      opinfo_tests=opinfo_tests, progress=progress, log_dir=log_dir)
            for s in suites or SUITES]


# --- the worker ------------------------------------------------------------------------------

def _compat_names():
    """Names that test files of other PyTorch releases import from torch.testing._internal
    and the installed release lacks (or gained later): defined only where missing, so older
    checkouts import; their tests run against the installed torch."""
    def binary_ufuncs_and_refs():
        from torch.testing._internal import common_methods_invocations as cmi
        from torch.testing._internal.opinfo.core import BinaryUfuncInfo
        return tuple(op for op in cmi.op_db + cmi.python_ref_db if isinstance(op, BinaryUfuncInfo))

    def foreach_lerp_op_db():
        from torch.testing._internal import common_methods_invocations as cmi
        ops = [op for name in dir(cmi) if name.startswith("foreach_") and name.endswith("_op_db")
               for op in getattr(cmi, name)]
        return [op for op in ops if "lerp" in op.name]

    def moved(module, name):  # a name that now lives in another module of the package
        def get():
            import importlib
            return getattr(importlib.import_module(f"torch.testing._internal.{module}"), name)
        return get

    def skip_ops():  # 2.1 took (class name, test name, specs); newer releases read the names
        from torch.testing._internal.common_device_type import skipOps
        return lambda *args: skipOps(args[-1])

    def new_module_tests():
        from torch.testing._internal import common_nn
        return common_nn.get_new_module_tests()

    return {
        "torch.testing._internal.common_utils": {"skipIfMps": lambda: (lambda fn: fn)},
        "torch.testing._internal.common_cuda": {"tf32_is_not_fp32": lambda: (lambda: False)},
        "torch.testing._internal.common_methods_invocations": {
            **{name: moved("common_device_type", name) for name in ("xfail", "skip")},
            "skipOps": skip_ops,
            "binary_ufuncs_and_refs": binary_ufuncs_and_refs,
            "foreach_lerp_op_db": foreach_lerp_op_db},
        "torch.testing._internal.common_nn": {"new_module_tests": new_module_tests},
    }


def _import_test_file(tests, file):
    import importlib
    module_name = file[:-3].replace("/", ".")
    from .._frontend import patches
    patches.older_pytorch_test_files()
    sys.path.insert(0, tests)
    sys.argv = [os.path.join(tests, file)]  # common_utils parses sys.argv at import
    compat = _compat_names()
    for _ in range(20):
        try:
            return importlib.import_module(module_name)
        except ImportError as exc:
            m = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(exc))
            make = compat.get(m.group(2), {}).get(m.group(1)) if m else None
            if make is None:
                raise
            setattr(sys.modules[m.group(2)], m.group(1), make())
            for name in [n for n in sys.modules if n == module_name]:
                del sys.modules[name]
    raise ImportError(f"{file}: too many missing names")


def _opinfo_test(cls, name):
    """Whether a generated test is one OpInfo's instance of an @ops test (its bound parameters,
    instantiate_test's `param_kwargs` default, hold the OpInfo)."""
    defaults = getattr(getattr(cls, name), "__defaults__", None) or ()
    return any(isinstance(d, dict) and "op" in d for d in defaults)


def _generated_classes(module, classes):
    """The tpu classes generated from `classes` (all generated ones when empty)."""
    out = []
    for name in sorted(vars(module)):
        base = _generic_name(name)
        if base is None or not isinstance(vars(module)[name], type):
            continue
        if classes and base not in classes:
            continue
        out.append(name)
    return out


def _generic_name(name):
    """`TestFoo` for a generated tpu class: `TestFooPRIVATEUSE1`, or `TestFooTPU` once an earlier
    class's setup has renamed PrivateUse1TestBase.device_type to the backend's name."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)]
    return None


def _exc_text(err, limit=500):
    exc_type, exc, _ = err
    text = " ".join(ln.strip() for ln in str(exc).splitlines()[:4] if ln.strip())
    return f"{exc_type.__name__}: {text}"[:limit]


def _run_one(module, test_id):
    import unittest

    class Result(unittest.TestResult):
        first = None

        def addError(self, test, err):
            self.first = self.first or err
            super().addError(test, err)

        def addFailure(self, test, err):
            self.first = self.first or err
            super().addFailure(test, err)

        def addSubTest(self, test, subtest, err):
            if err is not None:
                self.first = self.first or err
            super().addSubTest(test, subtest, err)

    cls_name, _, name = test_id.partition(".")
    cls = getattr(module, cls_name, None)
    if cls is None or not hasattr(cls, name):
        return {"status": "missing", "message": "no such test", "seconds": 0.0}
    result = Result()
    t = time.time()
    cls(name).run(result)
    try:  # a device-side check the test left pending fails this test, not the next one
        import torch
        torch.tpu.synchronize()
    except Exception:  # noqa: BLE001 - reported as the test's failure
        result.first = result.first or sys.exc_info()
    seconds = round(time.time() - t, 3)
    if result.first is not None:
        return {"status": FAILED, "message": _exc_text(result.first), "seconds": seconds}
    if result.unexpectedSuccesses:
        return {"status": FAILED, "message": "unexpected success", "seconds": seconds}
    if result.skipped:
        return {"status": SKIPPED, "message": str(result.skipped[0][1])[:300], "seconds": seconds}
    return {"status": PASSED, "message": "", "seconds": seconds}


def worker_main(argv):
    tests, file, mode, classes = argv
    classes = tuple(c for c in classes.split(",") if c)
    names = json.loads(sys.stdin.read() or "[]")
    # The protocol gets the real stdout; what tests print goes to the log (stderr).
    with os.fdopen(os.dup(1), "w", buffering=1) as proto:
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        _serve(proto, tests, file, mode, classes, names)
    return 0


def _serve(proto, tests, file, mode, classes, names):
    import warnings
    warnings.simplefilter("default")
    import torchtpu  # noqa: F401  (names the PrivateUse1 backend before the test file imports)
    import torch
    torch.tpu.enable_cpu_fallback = False
    module = _import_test_file(tests, file)
    if mode == "list":
        import unittest
        ids = [[f"{c}.{t}", _opinfo_test(getattr(module, c), t)]
               for c in _generated_classes(module, classes)
               for t in unittest.defaultTestLoader.getTestCaseNames(getattr(module, c))]
        proto.write(json.dumps({"tests": ids}) + "\n")
        return
    for test_id in names:
        proto.write(json.dumps({"start": test_id}) + "\n")
        r = _run_one(module, test_id)
        proto.write(json.dumps(dict(r, test=test_id)) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: python -m torchtpu.conformance --pytorch-tests PATH")
