"""How an op runs in each eager mode, once its program is known: one runner per mode, for each
kind of op, in a table (`runners_for`).

  strict eager (DEFER_NEVER)    run now, asynchronously: the executable is called (or the op is
                                queued behind its compile: async_compile) and its outputs become
                                new tensors; its checks are read at the host's next wait
  fused eager (DEFER_AND_FUSE)  recorded into the trace (recording.record); its outputs are Pending
  debug eager (DEFER_NEVER_AND_LAUNCH_BLOCKING)
                                run now and waited for; a failure names the op, its inputs and
                                the user's line, and its checks are read at once
  a capture (modes.CAPTURE)     recorded as in fused eager, every op, into a trace that runs
                                nothing before the capture ends: an op that needs a value
                                (data-dependent, a collective of its own) breaks the capture

Kinds of op: those of the table; data-dependent ones (`eager=True` lowerings: their values
decide their outputs' shapes), which wait for their inputs and run their lowering un-jitted;
collectives (`mesh=`), which run over their process group's mesh as a program of their own,
or inside a fused segment that then runs on every rank.

A runner is called as runner(kernel, compiled, vals, call) with the op's kernel, its program
(op_programs.OpProgram), its bound arguments and its op_keys.Call (the random ops' (seed, offset)
already drawn at the front of `call.scalars`).  Outside a fused trace Python numbers are passed
as device scalars (op_keys.device_scalars); a trace packs them itself.
"""
import jax

from .._core import metrics, storage
from .._core.dtypes import to_torch_dtype
from .._core.metrics import FlushReason
from . import async_compile, debug, fused, modes, recording, spmd, sync
from .op_keys import device_scalars
from .op_programs import one_value, wrap_specs
from .op_results import commit, finish, may_donate, raise_failed_checks

_STRICT = modes.EagerMode.DEFER_NEVER
_FUSED = modes.EagerMode.DEFER_AND_FUSE
_BLOCKING = modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
_CAPTURE = modes.CAPTURE


# --- strict eager ------------------------------------------------------------------------------
def _strict(kernel, compiled, vals, call):
    scalars = device_scalars(call.scalars, call.device)
    if async_compile.enabled():
        metrics.counters[kernel.metric_key] += 1
        return async_compile.run(kernel, compiled, vals, call.buffers, scalars, call.device)
    return _now(kernel, compiled, vals, call.buffers, scalars, call.device)


def _now(kernel, compiled, vals, buffers, scalars, device):
    """Call the executable now, on its inputs' arrays (waiting for any still to come)."""
    arrays = [b.value() for b in buffers]
    metrics.counters[kernel.metric_key] += 1
    run = compiled.donor if may_donate(compiled, arrays) else compiled.fn
    return finish(kernel, compiled, vals, run(*arrays, *scalars), buffers, device)


def _strict_now(kernel, compiled, vals, call):
    return _now(kernel, compiled, vals, call.buffers, device_scalars(call.scalars, call.device),
                call.device)


def _strict_collective(kernel, compiled, vals, call):
    if compiled.mesh is None:  # a group of one process: an op like any other
        return _strict(kernel, compiled, vals, call)
    return _strict_now(kernel, compiled, vals, call)  # never queued behind its compile


# --- fused eager -------------------------------------------------------------------------------
def _record(kernel, compiled, vals, call):
    if not call.buffers and not kernel.low.random and one_value(compiled):
        # A single value made from Python numbers runs at once, outside the trace: code that
        # creates such state lazily on its first call (GradScaler's scale and growth tracker)
        # would otherwise make the first step's segment differ from the later ones.
        return _strict_now(kernel, compiled, vals, call)
    return recording.record(kernel, compiled, vals, call.buffers, call.scalars, call.device)


def _record_collective(kernel, compiled, vals, call):
    if compiled.mesh is None or spmd.in_program():
        return _record(kernel, compiled, vals, call)
    fused.flush(FlushReason.COLLECTIVE, kernel.overload)  # a program of its own
    return _now(kernel, compiled, vals, call.buffers, call.scalars, call.device)


# --- a capture ---------------------------------------------------------------------------------
def _capture(kernel, compiled, vals, call):
    return recording.record(kernel, compiled, vals, call.buffers, call.scalars, call.device)


# --- debug eager -------------------------------------------------------------------------------
def _blocking(kernel, compiled, vals, call):
    """Wait for the op, and name it, its inputs and the caller on failure."""
    async_compile.drain()  # debug mode runs every op in order, at its call
    buffers = call.buffers
    arrays = [b.value() for b in buffers]
    scalars = device_scalars(call.scalars, call.device)
    metrics.counters[kernel.metric_key] += 1
    metrics.counters["blocking_waits"] += 1
    try:
        outs, updated, checks = compiled.fn(*arrays, *scalars)
        jax.block_until_ready((outs, updated))
    except Exception as e:
        raise debug.attributed(e, kernel.overload, debug.describe_inputs(vals),
                               debug.user_frame(3)) from e
    if compiled.mesh is not None:
        sync.wait()  # (a collective: whether the ranks agreed on it, read at it)
    if modes.check_nans and not checks:
        bad = debug.first_non_finite(list(outs) + list(updated))
        if bad is not None:
            raise RuntimeError(
                f"{kernel.overload} produced NaN or Inf (TORCHTPU_CHECK_NANS=1); inputs: "
                f"{debug.describe_inputs(vals)}; called from "
                f"{debug.format_where(debug.user_frame(3))}")
    if checks:
        raise_failed_checks(compiled, checks)
    return commit(compiled, vals, outs, updated, buffers, call.device)


# --- data-dependent ops --------------------------------------------------------------------------
def _data_dependent(kernel, compiled, vals, call, scalars):
    """Wait for the inputs, run the lowering (un-jitted), and give the outputs the shapes its
    values decided."""
    buffers = call.buffers
    arrays = [b.value() for b in buffers]
    metrics.counters[kernel.metric_key] += 1
    metrics.counters["syncs"] += 1
    sync.wait()  # its values decide its outputs' shapes
    outs, updated, checks = compiled.fn(*arrays, *scalars)
    if checks:
        raise_failed_checks(compiled, checks)
    if not compiled.out_specs:
        compiled.out_specs = [
            (tuple(o.shape), storage.contiguous_strides(o.shape), to_torch_dtype(o.dtype))
            for o in outs]
        compiled.wrap_specs = wrap_specs(compiled.out_specs)
    return commit(compiled, vals, outs, updated, buffers, call.device)


def _data_dependent_now(kernel, compiled, vals, call):
    return _data_dependent(kernel, compiled, vals, call, device_scalars(call.scalars, call.device))


def _data_dependent_in_trace(kernel, compiled, vals, call):
    if not call.buffers and not kernel.low.random:
        return _data_dependent_now(kernel, compiled, vals, call)  # (as _record's single values)
    return _data_dependent_after_flush(kernel, compiled, vals, call)


def _data_dependent_after_flush(kernel, compiled, vals, call):
    fused.flush(FlushReason.DATA_DEPENDENT, kernel.overload)  # (a capture: CaptureBroken)
    return _data_dependent(kernel, compiled, vals, call, call.scalars)


def _data_dependent_blocking(kernel, compiled, vals, call):
    async_compile.drain()
    return _data_dependent_now(kernel, compiled, vals, call)


_TABLE_OPS = {_STRICT: _strict, _FUSED: _record, _BLOCKING: _blocking, _CAPTURE: _capture}
_DATA_DEPENDENT = {_STRICT: _data_dependent_now, _FUSED: _data_dependent_in_trace,
                   _BLOCKING: _data_dependent_blocking, _CAPTURE: _data_dependent_after_flush}
# A collective is a program over its group's mesh (compiled.mesh; None for a group of one
# process, whose collectives run as the table's ops do).
_COLLECTIVES = {_STRICT: _strict_collective, _FUSED: _record_collective, _BLOCKING: _blocking,
                _CAPTURE: _capture}


def runners_for(low):
    """{eager mode: runner} for the ops of lowering `low`."""
    if low.eager:
        return _DATA_DEPENDENT
    if low.mesh is not None:
        return _COLLECTIVES
    return _TABLE_OPS
