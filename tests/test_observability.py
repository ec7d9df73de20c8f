"""Metrics after a training loop, the metrics report, and the profilers."""
import gzip
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import torchtpu
from torchtpu._execution.kernels import kernel_for


def _loop(steps, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 8).to("tpu"), torch.randint(0, 4, (32,)).to("tpu")
    with torch.tpu.set_eager_mode(mode):
        for i in range(steps):
            if i == 2:  # after warm-up (momentum buffers exist from the second step)
                torchtpu.reset_metrics()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()


def test_metrics_count_what_a_steady_loop_implies():
    _loop(5, torch.tpu.EagerMode.DEFER_NEVER)
    m = torchtpu.metrics()
    assert m["device_to_host"] == 3 and m["device_to_host_bytes"] == 3 * 4  # one .item() per step
    assert m.get("host_to_device", 0) == 0
    assert m["op::aten.addmm.default"] == 3 * 2  # two Linear layers
    assert m.get("compiles", 0) == 0  # every op executable was already built
    assert m["ops"] == sum(v for k, v in m.items() if k.startswith("op::"))


def test_fused_metrics_count_flushes_by_reason():
    _loop(5, torch.tpu.EagerMode.DEFER_AND_FUSE)
    m = torchtpu.metrics()
    assert m["flush::optimizer_step"] == 3 and m["flush::backward"] == 3
    assert m.get("segment_compiles", 0) == 0 and m["segment_cache_hits"] == 6
    assert m["fused_ops"] == m["ops"] > 0


def test_metrics_report_is_a_readable_table():
    _loop(3, torch.tpu.EagerMode.DEFER_AND_FUSE)
    text = torchtpu.metrics_report()
    for heading in ("Execution", "Transfers", "Flush reasons", "Ops by name"):
        assert heading in text
    assert "optimizer_step" in text and "aten.addmm.default" in text


def test_metrics_printed_at_exit_when_asked():
    out = subprocess.run([sys.executable, "-c", "import torch, torchtpu; (torch.ones(3, device='tpu') * 2).sum().item()"],
                         env={**os.environ, "TORCHTPU_METRICS": "1"}, capture_output=True, text=True, check=True)
    assert "TorchTPU metrics" in out.stdout and "aten.mul.Tensor" in out.stdout


def test_torch_profiler_records_tpu_ops_and_torchtpu_spans(tmp_path):
    torchtpu.clear_caches()
    x = torch.randn(16, 16, device="tpu")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        (x @ x).relu().sum().item()
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            (x + 1).tanh().sum().item()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}
    assert "aten::mm" in names
    assert any(n.startswith("torchtpu::compile aten.mm") for n in names)
    assert any(n.startswith("torchtpu::flush") for n in names)


def test_jax_trace_captures_device_executables(tmp_path):
    x = torch.randn(64, 64, device="tpu")
    with torchtpu.profiler.trace(tmp_path):
        (x @ x).sum()
    assert list(tmp_path.rglob("*.xplane.pb"))  # TensorBoard's profile plugin reads this
    (perfetto,) = tmp_path.rglob("perfetto_trace.json.gz")
    text = gzip.decompress(perfetto.read_bytes()).decode(errors="replace")
    # The op executables ran inside the trace (JAX names a module for its function).
    compiled = kernel_for(torch.ops.aten.mm.default).cache.values()
    assert any(f"jit_{c.run.__name__}" in text for c in compiled), "no mm executable in the trace"
