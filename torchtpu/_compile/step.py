"""`torch.compile(step, backend="tpu", mode="reduce-overhead")`: a whole compiled step (forward,
`loss.backward()`, `optimizer.step()`, `zero_grad()`) as one executable, replayed with no Python
between its graphs.

Dynamo splits such a step into several graphs with Python between them (the autograd engine
runs the backward graph; `zero_grad` and optimizer hooks break the frame), and it and
AOTAutograd cost seconds in every process, a restart's included.  This mode therefore does what
torch.tpu graphs do, without them: the first call runs eagerly (warm-up, which also creates the
optimizer's state, on the device: optimizers whose state does not exist yet are made
capturable, as Dynamo makes them for a compiled step; inductor's CUDA graphs also warm up
once), and the same call then captures the step, run eagerly again, as a torch.tpu graph
(tpu_graphs.py), without waiting for the warm-up's ops: the step's executable compiles on the
compile pool beside the warm-up's own compiles.  From the second call on it replays that
executable: each call only binds the new arguments' storages, checks what the capture baked
in, and makes the returned tensors.  A restart finds the executable in the persistent cache.
Dynamo compiles the step only when a call cannot replay (below).  The step's Python so runs
twice in the first call and not after it.

As with CUDA graphs under inductor's "reduce-overhead", Python in the step does not run at
replay: Python numbers and control flow are those of the captured call.  What is checked at
each call, falling back to the Dynamo-compiled step (graph by graph) when it differs: the
tensor arguments' layouts, the other arguments' values, grad mode, autocast, and the
optimizers' Python hyperparameters (a Python-number lr that a scheduler changes runs the Dynamo
path, which recompiles per value; a tpu tensor lr with capturable=True replays).  Parameters
and optimizer state are read from their storages at each replay, so in-place updates outside
the step (a scheduler's lr.fill_, `copy_` into a parameter, load_state_dict) are seen; a
parameter replaced by another tensor (`p.data = t`) is not.  Returned tensors the step creates are new at each call.
"""
import contextlib
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._core import metrics, storage
from .._core.metrics import FlushReason
from .._execution import recording, tpu_graphs
from . import backend, fx_graph


class _Fallback(Exception):
    pass


class WholeStep:
    """The callable `torch.compile(..., backend="tpu", mode="reduce-overhead")` returns."""

    def __init__(self, compiled):
        self._compiled = compiled
        # What torch.compile wrapped: the module, or the function.
        self._eager = getattr(compiled, "_orig_mod", None)
        if self._eager is None:
            self._eager = compiled._torchdynamo_orig_callable
        self._steps = {}  # call key -> _StepReplay, or None: runs the Dynamo path
        self._retries = {}  # call key -> eager captures that read the host, so far

    def __getattr__(self, name):  # the wrapped OptimizedModule's attributes
        return getattr(self.__dict__["_compiled"], name)

    def __call__(self, *args, **kwargs):
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            flat, spec = tree_flatten((args, kwargs))
        else:  # the common case, without pytree's cost (a third of a replay's Python)
            flat, spec = args, len(args)
        try:
            key = _call_key(flat, spec)
            hash(key)
        except TypeError:  # an unhashable argument: nothing to compare a capture against
            return self._compiled(*args, **kwargs)
        step = self._steps.get(key, False)
        if step is False:  # warm up, then capture
            with capturable_optimizers():
                out = self._eager(*args, **kwargs)
            step = self._capture(flat, args, kwargs, key)
            if step is not _RETRY:
                self._steps[key] = step
            return out
        if step is not None:
            changed = step.graph.hyperparameters_changed()
            if changed is None:
                return step.replay(flat)
            warnings.warn(f"torchtpu: compiled step runs graph by graph from now on: {changed}")
            self._steps[key] = None
        return self._compiled(*args, **kwargs)

    def _capture(self, flat, args, kwargs, key):
        # The eager step first; then the step as Dynamo compiles it, whose Python can differ
        # where PyTorch branches on torch.compiler.is_compiling() (e.g. SGD with a tensor lr
        # reads it on the host in eager, not in a compiled step).  A failed capture leaves
        # every tensor as it was (tpu_graphs.graph).  The capture does not wait for the warm-up
        # call's ops, and the executable compiles on the pool: the warm-up's own compiles,
        # the capture's and its compile overlap, and the next call's replay waits for it.
        for fn in (self._eager, self._compiled):
            g = tpu_graphs.TPUGraph()
            try:
                with tpu_graphs.graph(g, _wait=False):
                    out = fn(*args, **kwargs)
                step = _StepReplay(g, flat, out)
            except (RuntimeError, _Fallback) as e:
                tries = self._retries.get(key, 0)
                if fn is self._eager and _read_the_host(e) and tries < _MAX_RETRIES:
                    # Code that reads the host in its first steps only (DDP rebuilds its
                    # gradient buckets at the second, agreeing on them through the host):
                    # another eager warm-up, then capture again, at the next call.
                    self._retries[key] = tries + 1
                    return _RETRY
                error = e
                continue
            metrics.counters["step_captures"] += 1
            return step
        warnings.warn(f"torchtpu: compiled step runs graph by graph (it cannot be captured "
                      f"as one executable): {error}")
        return None


_RETRY = object()
_MAX_RETRIES = 2


def _read_the_host(error):
    """Whether a capture failed because the step read a value on the host."""
    cause = error.__cause__
    return isinstance(cause, recording.CaptureBroken) and cause.reason in (
        FlushReason.ITEM, FlushReason.DEVICE_TO_HOST, FlushReason.READ)


@contextlib.contextmanager
def capturable_optimizers():
    """Optimizers stepped meanwhile whose state does not exist yet keep it on the device
    (capturable), as a compiled step's do (backend.mark_capturable): a host `step` counter
    would be baked into the captured graph, which refuses such optimizers."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: backend.mark_capturable(optimizer))
    try:
        yield
    finally:
        hook.remove()


def _call_key(flat, spec):
    key = [spec, torch.is_grad_enabled(), torch.is_autocast_enabled("tpu"),
           torch.get_autocast_dtype("tpu")]
    for a in flat:
        if isinstance(a, torch.Tensor):
            key.append(fx_graph.arguments_key([a])[0] + (a.requires_grad,))
        else:
            key.append((type(a), a))
    return tuple(key)


class _StepReplay:
    """One captured call of the whole step, for replay: its torch.tpu graph, which graph
    inputs the arguments are, and what it returns."""

    def __init__(self, g, flat, out):
        self.graph = g
        position = {id(b): k for k, b in enumerate(g.input_storages)}
        written = set(g.written_inputs)
        self.arguments = []  # (graph input index, position in the flat arguments)
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor):
                k = position.get(id(storage.buffer_or_none(a)))
                if k in written:
                    raise _Fallback("it writes into one of its tensor arguments")
                if k is not None:
                    self.arguments.append((k, i))
        self.args = {id(a): i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
        created = {id(b) for b in g.output_storages}
        outs, self.out_spec = tree_flatten(out)
        if not g.ran_backward and any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
            # A forward whose backward runs outside: its results need their autograd graph.
            raise _Fallback("it returns tensors that require grad and runs no backward pass")
        self.outputs = []  # per returned leaf: ("new", tensor) | ("arg", i) | ("same", value)
        for o in outs:
            if isinstance(o, torch.Tensor) and id(storage.buffer_or_none(o)) in created:
                self.outputs.append(("new", o))
            elif isinstance(o, torch.Tensor) and id(o) in self.args:
                self.outputs.append(("arg", self.args[id(o)]))
            else:
                self.outputs.append(("same", o))

    def replay(self, flat):
        inputs = {k: storage.buffer_or_none(flat[i]) for k, i in self.arguments}
        self.graph.replay(inputs, checked=True)  # WholeStep.__call__ compared the hyperparameters
        outs = []
        for kind, v in self.outputs:
            if kind == "new":  # a new tensor on the array the replay just wrote
                buf = storage.buffer_or_none(v)
                t = storage.wrap(buf.peek(), list(v.shape), list(v.stride()), v.dtype,
                                 buf.index, buf.nbytes, v.storage_offset())
                outs.append(t)
            elif kind == "arg":
                outs.append(flat[v])
            else:
                outs.append(v)
        return tree_unflatten(outs, self.out_spec)


def whole_step(compile_):
    """`torch.compile` wrapper: mode="reduce-overhead" with backend="tpu" gives a WholeStep."""
    def compile(model=None, **kwargs):
        if kwargs.get("backend") != "tpu" or kwargs.get("mode") != "reduce-overhead":
            return compile_(model, **kwargs) if model is not None else compile_(**kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != "mode"}
        if model is None:
            return lambda m: WholeStep(compile_(m, **kwargs))
        return WholeStep(compile_(model, **kwargs))
    return compile
