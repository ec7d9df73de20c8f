"""Giving an op's results their tensors once its executable ran (strict eager, debug eager, an
op queued behind its compile) or was recorded (fused eager): new outputs become tensors over
new storages, in-place results replace the written storages' arrays, and the call returns what
the schema says (a new tensor, a mutated argument, a list, a number its meta kernel fixed).
Nothing is committed before the executable returned, so a failing op leaves every tensor as it
was; its device-side checks are read at the host's next wait (sync.defer)."""
import sys

from .._core import storage
from . import debug, sync


class Number:
    """A return that is a number, the same for every call of the executable (its meta kernel
    computes it from the shapes)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def finish(kernel, compiled, vals, results, buffers, device):
    """Defer the checks of a strict op that ran, and give its results their tensors."""
    outs, updated, checks = results
    if checks:
        defer_checks(kernel, compiled, checks)
    return commit(compiled, vals, outs, updated, buffers, device)


def defer_checks(kernel, compiled, checks, where=None):
    """Read `checks` at the next wait of the host, not now (sync.defer)."""
    if where is None:
        where = debug.user_frame(3)
    sync.defer(checks, lambda values: debug.failed_check(
        values, compiled, kernel.overload, where, "its in-place targets kept their values"))


def raise_failed_checks(compiled, checks):
    error = compiled.check_error(checks)
    if error is not None:
        raise error


def commit(compiled, vals, outs, updated, buffers, device):
    """The written storages take their new arrays, the new outputs get tensors; the call's
    return value."""
    for j, arr in zip(compiled.writes, updated):
        buffers[j].array = arr
    new = [storage.wrap(arr, shape, stride, dtype, device, nbytes)
           for arr, (shape, stride, dtype, nbytes) in zip(outs, compiled.wrap_specs)]
    if outs:
        sync.track(outs[0])
    elif updated:
        sync.track(updated[0])
    return returns(compiled, vals, new)


def returns(compiled, vals, new):
    """What the op returns, given the tensors of its new outputs (`new`)."""
    sources = compiled.returns
    if len(sources) == 1 and sources[0] is None:  # one new tensor, as most ops return
        return new[0]
    results = []
    it = iter(new)
    for source in compiled.returns:
        if source is None:
            results.append(next(it))
        elif source == "none":
            results.append(None)
        elif isinstance(source, Number):
            results.append(source.value)
        elif source == "list":
            results.append([next(it) for _ in range(compiled.list_len)])
        else:
            results.append(vals[source])
    if not results:
        return None
    return results[0] if len(results) == 1 else tuple(results)


def may_donate(compiled, arrays):
    """Whether a strict op calls the executable that reuses the buffers of the storages it
    writes (`donor`) on `arrays` (its storages' arrays): where it has one and nothing else
    holds them."""
    if compiled.donor is None:
        return False
    # (references: the list, the storage, getrefcount's argument)
    return max(sys.getrefcount(arrays[j]) for j in compiled.writes) <= 3
