"""Bounded executable caches, fused mode under threads and interruption (issue 17, items 3-4).

Tests that depend on the eager mode take it as a parameter and switch to it themselves."""
import threading

import pytest
import torch

import torchtpu
from torchtpu._execution import bounded, fused, kernels

from conftest import MODES, assert_same


def evictions():
    m = torchtpu.metrics()
    return m.get("executable_evictions", 0), m.get("segment_evictions", 0)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_executable_caches_stay_within_their_bound(mode, monkeypatch):
    torchtpu.clear_caches()
    monkeypatch.setattr(bounded.op_executables, "capacity", 8)
    monkeypatch.setattr(fused._segments, "capacity", 3)
    before = evictions()
    with torch.tpu.set_eager_mode(MODES[mode]):
        for n in range(1, 25):
            a = torch.linspace(-2, 2, n)
            assert_same((a.to("tpu") * 3 + 1).sin(), (a * 3 + 1).sin())
            assert len(bounded.op_executables) <= 8
            assert sum(len(k.cache) for k in kernels._kernels.values()) <= 8
            assert len(fused._segments) <= 3
    after = evictions()
    assert after[0] - before[0] >= 24  # every new shape pushed older executables out
    if mode == "fused":
        assert after[1] - before[1] >= 20
    assert "executable_evictions" in torchtpu.metrics_report()


def test_evicted_executables_are_rebuilt_and_still_right(monkeypatch):
    torchtpu.clear_caches()
    monkeypatch.setattr(bounded.op_executables, "capacity", 2)
    a = torch.randn(5)
    for _ in range(3):  # each op evicts the other's executable: every call rebuilds one
        assert_same(torch.exp(a.to("tpu")), torch.exp(a))
        assert_same(torch.tanh(a.to("tpu")), torch.tanh(a))


def test_executable_cache_size_from_the_environment(monkeypatch):
    monkeypatch.delenv("TORCHTPU_EXECUTABLE_CACHE_SIZE", raising=False)
    assert bounded.size_from_environment() == 4096
    monkeypatch.setenv("TORCHTPU_EXECUTABLE_CACHE_SIZE", "17")
    assert bounded.size_from_environment() == 17
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("TORCHTPU_EXECUTABLE_CACHE_SIZE", bad)
        with pytest.raises(ValueError, match="TORCHTPU_EXECUTABLE_CACHE_SIZE"):
            bounded.size_from_environment()
