import pytest
import torch

import torchtpu  # noqa: F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def assert_same(tpu, cpu, rtol=1.3e-6, atol=1e-5):
    """Values, dtype, shape and strides of a tpu result equal the CPU reference."""
    assert tpu.device.type == "tpu", tpu.device
    assert tpu.dtype == cpu.dtype, (tpu.dtype, cpu.dtype)
    assert tpu.shape == cpu.shape, (tpu.shape, cpu.shape)
    assert tpu.stride() == cpu.stride(), (tpu.stride(), cpu.stride())
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=rtol, atol=atol, equal_nan=True)
