"""The PrivateUse1 kernel of every op of the lowering table, in every eager mode.

For each registered overload an `OpKernel` turns a call into
  key      op_keys: static args, each tensor's dtype/shape/strides/aliasing, scalar types, ...
  program  op_programs: on a miss, PyTorch's meta kernel and a `jax.jit` of
           read views -> lowering -> write back / store, built once and cached under the key
  run      op_runners: the runner of the current eager mode (strict: call it now,
           asynchronously; fused: record it; debug: call it and wait), which gives the results
           their tensors (op_results).
Two kinds of call take a path of their own first: random fills of sizes that are not bucket
sizes (`_bucketed_fill`), and ops on 1-D tensors with room to spare (padded.py).
"""
import threading

import numpy as np
import torch

from .._core import registry, storage
from . import bounded, modes, op_keys, op_programs, overlap, recording
from .op_programs import OutResized
from .op_runners import runners_for
from .random import draw_advance, generator, next_key_parts

_FUSED, _BLOCKING = modes.EagerMode.DEFER_AND_FUSE, modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
# The mode an op whose out= PyTorch resized runs in (OpKernel.__call__): waited for, except in a
# capture, which runs nothing before it ends.
_WAITED = {modes.CAPTURE: modes.CAPTURE}
_STRICT = modes.EagerMode.DEFER_NEVER
_NO_KEY = np.uint64(0)  # a random op's seed and offset before they are drawn


class OpKernel:
    """The PrivateUse1 kernel of one overload."""

    def __init__(self, overload, low):
        self.overload = overload
        self.low = low
        schema = overload._schema
        traced = low.traced
        if low.fill:  # (see Lowering.fill)
            traced += tuple(a.name for a in schema.arguments if str(a.type) == "float")
        self.args = op_keys.classify(schema, low.static, traced)
        self.params = registry.parameters(overload)
        self.functional_args = [i for i, a in enumerate(self.args) if not a.is_out]
        self.writes = [i for i, a in enumerate(self.args) if a.is_write]
        self.returns = schema.returns
        self.functional = registry.functional_of(overload)
        self.inplace_of = registry.inplace_functional_of(overload)
        self.cache = {}
        self.lock = threading.Lock()
        self.metric_key = f"op::{overload}"
        # An in-place random fill (uniform_, normal_, ...) of its first argument.
        self.fills = low.fill and self.writes == [0] and not self.args[0].is_out
        # This op's path for 1-D tensors with room to spare (padded.install), or None.
        self.padded = None
        self.runners = runners_for(low)  # {eager mode: how the op runs in it}

    # -- binding -------------------------------------------------------------------------
    def bind(self, args, kwargs):
        return registry.bind(self.params, args, kwargs)

    # -- the hot path ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.fills and args:
            done = self._bucketed_fill(args, kwargs)
            if done is not None:
                return done
        if self.padded is not None and args:
            first = args[0]
            if isinstance(first, torch.Tensor) and first.dim() == 1:
                done = self.padded(self, args, kwargs)
                if done is not None:
                    return done
        try:
            return self.call(args, kwargs)
        except OutResized as resized:
            try:
                # Run at once and waited for, as in debug mode: a device-side check that fails
                # (an integer fmod by zero) must raise here, while the out= tensors can still
                # get their old layouts back, not at a later wait (PyTorch checks before it
                # resizes).  Only ops whose out= is resized pay this wait.
                return self.call(args, kwargs, mode=_WAITED.get(modes.get_eager_mode(), _BLOCKING))
            except BaseException:
                # A failing op leaves its out= as it was (PyTorch checks before resizing).
                for t, shape, stride, offset in resized.args[0]:
                    t.as_strided_(shape, stride, offset)
                raise

    def _bucketed_fill(self, args, kwargs):
        """A random fill as strict eager runs it: for a contiguous tensor whose size is not a
        bucket size (fill_bucket), fill a flat tensor of the bucketed size, whose first
        elements are the very values the fill would give (Lowering.fill).  A tensor covering
        its storage takes that array as its storage's (a fresh `torch.empty(n).uniform_()`,
        `randn(n)`, a layer's initialisation: the spare elements, at most n under 64 Ki and
        n/8 above, are never read); any other gets the first elements copied.  A random
        program takes ~0.5 s of XLA:CPU compile (threefry), a copy ~30 ms: a loop over new
        sizes (PyTorch's device-generic tests) or a model initialised on the device compiled
        one per shape.
        Fused eager runs fills this way too, outside its trace: in a segment every fill is a
        threefry program of its own to compile (200 randn of one shape made a segment of 85 s
        of XLA compile), while here each bucket size compiles once and the segment only records
        the copy.  Their values are strict eager's.
        None: the fill runs as it is (in a capture, or strict eager at a bucket size)."""
        mode = modes.get_eager_mode()
        if mode is modes.CAPTURE:
            return None
        t = args[0]
        n = t.numel()
        in_trace = mode is _FUSED
        size = fill_bucket(n)
        if n == 0 or not t.is_contiguous() or size == n:
            return self.call(args, kwargs, mode=_STRICT) if in_trace else None
        flat = torch.empty(size, dtype=t.dtype, device=t.device)
        g = generator(storage.buffer_of(t).index)
        start = g.offset
        self(flat, *args[1:], **kwargs)  # draws with the key this call would have used
        g.offset = start + draw_advance(n)  # past this fill's n draws, not the bucket's
        if not recording.replace_value(t, storage.buffer_of(flat).value()):
            t.copy_(flat[:n].view(t.shape))
        return t

    def call(self, args, kwargs, mode=None):
        """Run the op in `mode` (None: the calling thread's eager mode)."""
        low = self.low
        vals = registry.bind(self.params, args, kwargs)
        if low.validate is not None:
            low.validate(*[vals[i] for i in self.functional_args])
        call = op_keys.key_of(self.args, vals, low.precision)
        scalars = call.scalars
        if low.random:  # (seed, offset): drawn below, once the op's size is known
            scalars = call.scalars = [_NO_KEY, _NO_KEY] + scalars
        compiled = self.cache.get(call.key)
        if compiled is None:
            compiled = op_programs.build_cached(self, call, vals, scalars)
        else:
            bounded.op_executables.lookup(compiled)  # marks it recently used
            if compiled.recheck_overlap:
                overlap.check(self, vals, resized=False)
                overlap.check(self, vals, resized=True)
        if compiled.variants is not None:
            compiled = op_programs.variant(self, compiled, vals, call, scalars)
        if low.random:
            scalars[0], scalars[1] = next_key_parts(call.device, compiled.draws)
        return self.runners[mode or modes.get_eager_mode()](self, compiled, vals, call)


def fill_bucket(n):
    """The size a random fill of n elements draws for: a power of two up to 64 Ki elements
    (small draws cost nothing), then 8 sizes per octave (at most 1/8 drawn in vain)."""
    if n <= 1 << 16:
        return 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 4)
    return -(-n // step) * step

