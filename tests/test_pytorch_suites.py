"""The runner of PyTorch's device-generic test suites (python -m torchtpu.conformance
--pytorch-tests PATH), on a tiny stand-in checkout written under pytest's tmp_path: a test that
passes, fails on tpu only, fails on both devices, skips, hangs and kills its process."""
import textwrap

from torchtpu.conformance import pytorch_suites as ps
from torchtpu.conformance.report import SUITES_BEGIN, format_suites, write_suites_doc

FAKE_SUITE = textwrap.dedent('''
    import os, time, unittest
    import torch
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.common_device_type import dtypes, instantiate_device_type_tests

    class TestShapeOps(TestCase):
        def test_passes(self, device):
            self.assertEqual(torch.ones(3, device=device).sum().item(), 3)

        def test_tpu_only(self, device):
            self.assertEqual(torch.device(device).type, "cpu")

        def test_both(self, device):
            self.assertEqual(1, 2)

        def test_skips(self, device):
            raise unittest.SkipTest("not here")

        def test_hangs(self, device):
            if torch.device(device).type != "cpu":
                time.sleep(120)

        def test_crashes(self, device):
            if torch.device(device).type != "cpu":
                os._exit(3)

        @dtypes(torch.float32, torch.int64)
        def test_dtypes(self, device, dtype):
            self.assertEqual(torch.zeros(2, device=device, dtype=dtype).dtype, dtype)

    instantiate_device_type_tests(TestShapeOps, globals())
''')


def test_names():
    assert ps.cpu_twin("TestFooPRIVATEUSE1.test_x_tpu_float32") == "TestFooCPU.test_x_cpu_float32"
    assert ps.cpu_twin("TestFooPRIVATEUSE1.test_tpu_thing_tpu") == "TestFooCPU.test_tpu_thing_cpu"
    assert ps.cpu_twin("TestFooTPU.test_x_tpu") == "TestFooCPU.test_x_cpu"
    assert ps.keep_test("test_x_tpu", True) and ps.keep_test("test_x_tpu_float32", True)
    assert ps.keep_test("test_x_tpu_float32_int64", True)
    assert not ps.keep_test("test_x_tpu_int64", True) and ps.keep_test("test_x_tpu_int64", False)
    assert ps.excluded("NotImplementedError: The operator 'aten::quantize_per_tensor.default' is "
                       "not implemented for the tpu device") == "quantized"
    assert ps.excluded("RuntimeError: dtype torch.complex32 is not supported") == "complex32"
    assert ps.excluded("The operator 'aten::_to_sparse.default' is not implemented") == "sparse"
    assert ps.excluded("AssertionError: Tensor-likes are not close!") is None


def test_runs_a_suite_with_hangs_and_crashes(tmp_path):
    tests = tmp_path / "pytorch" / "test"
    tests.mkdir(parents=True)
    (tests / "test_shape_ops.py").write_text(FAKE_SUITE)
    suite = ps.Suite("TestShapeOps", ("test_shape_ops.py",), ("TestShapeOps",), float32_only=True)
    [r] = ps.run_suites(str(tmp_path / "pytorch"), [suite], timeout=8, progress=False,
                        log_dir=str(tmp_path))
    assert r["error"] is None
    kinds = {t.partition(".")[2]: x["kind"] for t, x in r["tests"].items()}
    assert kinds == {
        "test_passes_tpu": "passed", "test_dtypes_tpu_float32": "passed",  # int64: not in the slice
        "test_tpu_only_tpu": "failed_tpu_only", "test_both_tpu": "failed_both",
        "test_skips_tpu": "skipped", "test_hangs_tpu": "crashed", "test_crashes_tpu": "crashed",
    }
    assert r["counts"] == {"ran": 7, "passed": 2, "failed_tpu_only": 1, "failed_both": 1,
                           "skipped": 1, "crashed": 2, "excluded": 0}
    assert "timed out" in r["tests"]["TestShapeOpsPRIVATEUSE1.test_hangs_tpu"]["message"]
    assert "exit 3" in r["tests"]["TestShapeOpsPRIVATEUSE1.test_crashes_tpu"]["message"]
    assert "AssertionError" in r["tests"]["TestShapeOpsPRIVATEUSE1.test_tpu_only_tpu"]["message"]
    assert "TestShapeOps" in format_suites([r], total=True)

    doc = tmp_path / "coverage.md"
    doc.write_text("# Operator coverage\n\nkept\n")
    for _ in range(2):  # the section is replaced, not repeated
        write_suites_doc(str(doc), [r], "python -m torchtpu.conformance --pytorch-tests X", 1.0)
    text = doc.read_text()
    assert text.count(SUITES_BEGIN) == 1 and "kept" in text and "test_tpu_only_tpu" in text
