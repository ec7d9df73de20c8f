"""A fixed subset of PyTorch's own device-generic tests, run on tpu on every change: the tests
whose failures the suite sweeps found and that are fixed (docs/pytorch_test_suites.md), and a few
hundred fast ones that passed, from PyTorch's test files in ../shared/pytorch-tests (or the
checkout TORCHTPU_PYTORCH_TESTS names). The full sweep is its own command:
`python -m torchtpu.conformance --pytorch-tests PATH`.

The ids are in pytorch_suite_subset.json, one list per file: each file's tests run in one worker
process (strict eager, the CPU fallback off), as the sweep runs them."""
import json
import os
import pathlib

import pytest

from torchtpu.conformance import pytorch_suites as ps

HERE = pathlib.Path(__file__).parent
SUBSET = json.loads((HERE / "pytorch_suite_subset.json").read_text())
CHECKOUT = os.environ.get("TORCHTPU_PYTORCH_TESTS", str(HERE.parent.parent / "shared" / "pytorch-tests"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("file", sorted(SUBSET))
def test_pytorch_tests_pass_on_tpu(file, tmp_path):
    try:
        tests = ps.test_dir(CHECKOUT)
    except FileNotFoundError:
        pytest.skip(f"PyTorch's test files are not at {CHECKOUT} (set TORCHTPU_PYTORCH_TESTS)")
    results = ps._run_tests(tests, file, (), SUBSET[file], timeout=300,
                            log=str(tmp_path / "worker.log"))
    failed = {t: f"{r['status']}: {r['message'][:300]}" for t, r in results.items()
              if r["status"] != ps.PASSED}
    assert not failed, "\n".join(f"{t}: {m}" for t, m in sorted(failed.items()))
