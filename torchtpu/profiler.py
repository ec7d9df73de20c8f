"""Seeing where time goes.

- `torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])`
  records every aten op dispatched to tpu (PyTorch's own op events) plus TorchTPU's spans:
  `torchtpu::compile <op>` (an op executable built), `torchtpu::flush (<reason>)` (a fused
  segment run), `torchtpu::graph <name>` (a compiled graph run). Host-side times: dispatch is
  asynchronous, so device time shows in the JAX trace below.
- `torchtpu.profiler.trace(log_dir)` captures a JAX/XLA trace (device executables with their
  device time where the platform reports it) viewable in TensorBoard or Perfetto.
"""
import contextlib

import jax
import torch

from ._execution import fused
from ._core.metrics import FlushReason, span  # noqa: F401  (span: re-exported)


@contextlib.contextmanager
def trace(log_dir, create_perfetto_trace=True):
    """Capture a JAX/XLA trace of the block into `log_dir` (pending tpu work is run first and
    waited for at the end, so the trace holds exactly the block's device work)."""
    torch.tpu.synchronize()
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=create_perfetto_trace):
        yield
        fused.flush(FlushReason.SYNCHRONIZE)
        torch.tpu.synchronize()
