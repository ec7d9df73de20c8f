"""Running a recorded op sequence: a `Segment` is one recording's program and the rules for
running it, the same for a fused eager segment, a torch.tpu graph, a `torch.compile` graph and
`torchtpu.scaling`'s step: the recorded ops composed into one JAX function
(`segment_function`), its Python numbers packed or baked in, one executable per pattern of
donated inputs (`_Order`), compile and cache-hit accounting, and which op's device-side check
failed.
"""
import contextlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .._core import metrics, runtime
from .._lowerings.rounding import round_to
from . import async_compile, debug, executables, spmd
from .random import next_key_parts

# Eager rounds every op's result to its dtype; XLA by default may keep a fused chain of
# half-precision ops in float32, so fused eager would differ from strict eager (exp(3 * x) in
# bfloat16 by up to 4%).  Fused eager promises eager's values, so the rounding stays.
EAGER_ROUNDING = {"xla_allow_excess_precision": False}


def _rounded_half(values):
    """XLA:CPU keeps float16 arithmetic in float32 through a fused loop whatever that option
    says (x * y + x in float16 rounds once: measured 1,208 of 4,096 values off the CPU's), so
    on the CPU each op's float16 results are rounded explicitly (a reduce_precision, which
    nothing removes).  bfloat16 is rounded as asked; TPUs and GPUs compute float16 natively."""
    if runtime.program_platform() != "cpu":
        return values
    return [round_to(v.astype(jnp.float32), jnp.float16).astype(jnp.float16)
            if getattr(v, "dtype", None) == jnp.float16 else v for v in values]



# Python numbers are passed to the segment packed into one array per type (one transfer
# instead of one per number) and unpacked as weakly typed values, which is what a Python
# number passed to a jitted function becomes: `x * 0.5` keeps x's dtype.
PACKED = {float: np.float64, int: np.int64, bool: np.bool_, complex: np.complex128}


def pack_scalars(scalars, types):
    groups = {t: [] for t in PACKED}
    other = []
    for v, t in zip(scalars, types):
        (groups[t] if t in groups else other).append(v)
    packed = PACKED if runtime.platform() != "tpu" else _PACKED_FOR_TPU
    return [np.array(groups[t], dtype) for t, dtype in packed.items()], other


# XLA:TPU has no complex128 (op_keys.narrow_complex)
_PACKED_FOR_TPU = {**PACKED, complex: np.complex64}


def _packed_type(t):
    """The type of a number baked into the program being traced."""
    return (_PACKED_FOR_TPU if runtime.program_platform() == "tpu" else PACKED)[t]


def _unpack_scalars(packed, types):
    arrays, other = packed
    position = dict.fromkeys(PACKED, 0)
    columns = dict(zip(PACKED, arrays))
    values = []
    other_it = iter(other)
    for t in types:
        if t in columns:
            v = columns[t][position[t]]
            position[t] += 1
            values.append(v if t is bool else as_weak(v))
        else:
            values.append(next(other_it))
    return values


class PackedScalars:
    """A recorded op sequence's Python numbers packed once (pack_scalars), with its random ops'
    (seed, offset) pairs, drawn anew for every run (`for_run`)."""

    __slots__ = ("arrays", "other", "random", "device")

    @classmethod
    def of(cls, recorded):
        """A Recording's numbers (recording.py)."""
        return cls(recorded.scalars, recorded.scalar_types, recorded.random_positions(),
                   recorded.device)

    def __init__(self, scalars, types, random, device):
        self.arrays, self.other = pack_scalars(scalars, types)
        in_other = [i for i, t in enumerate(types) if t not in PACKED]
        self.random = [(in_other.index(pos), draws) for pos, draws in random]
        self.device = device

    def for_run(self):
        if not self.random:
            return self.arrays, self.other
        other = list(self.other)
        for i, draws in self.random:
            other[i], other[i + 1] = next_key_parts(self.device, draws)
        return self.arrays, other


def as_weak(v):
    """`v` as a Python number passed to a jitted function becomes: weakly typed."""
    from jax._src.lax.lax import _convert_element_type
    return _convert_element_type(v, weak_type=True)


def structure_key(signature, outputs, scalar_types, guarded, constants=None):
    """A recorded op sequence's key in the persistent cache (None: not storable): its ops' own
    keys, their wiring, what it returns, which inputs it overwrites, and the numbers it bakes
    in."""
    ops = [(getattr(c.fn, "key", None), wiring, n) for c, wiring, n in signature]
    if any(k is None for k, _, _ in ops):
        return None
    return executables.stable((ops, outputs, [t.__name__ for t in scalar_types], tuple(guarded))
                              + ((constants,) if constants is not None else ()))


def baked_numbers(scalars, scalar_types):
    """The numbers a graph bakes into its program (Segment's `constants`): every Python number
    of the recording (None in the place of each random op's (seed, offset), drawn anew for
    every run).  A graph runs with the numbers of its capture (torch.tpu graphs, a whole step)
    or is recorded per value of them (a compiled graph: its key holds its inputs' offsets and
    its non-tensor arguments), so they are constants of its program, as they are of JAX's:
    XLA folds them, and the views' offsets among them make static slices of the storages'
    dims (strided.py) where runtime offsets made dynamic slices of flattened storages, which
    on TPU cost a relayout of the storage each (and 64-bit emulation for the offsets)."""
    return tuple(v if t in PACKED else None for v, t in zip(scalars, scalar_types))


def checks_info(signature):
    """An Executable's `traced` hooks for a recorded op sequence: its ops' index-check messages,
    learnt by tracing, are stored with the entry, and a loaded (untraced) one restores them."""
    def save():
        return [list(c.check_info) for c, _, _ in signature]

    def restore(saved):
        for (c, _, _), info in zip(signature, saved):
            if not c.check_info:
                c.check_info[:] = info
    return save, restore


class Segment:
    """One recorded op sequence (a fused segment or a compiled graph) and the rules for running
    it, the same for both: which inputs it may consume, one executable per pattern of donated
    inputs, compile/cache-hit accounting (`{kind}_compiles`, `{kind}_cache_hits`) and finding
    the op whose index check failed.  `prepare` then `run`."""

    __slots__ = ("structure", "executables", "has_checks", "kind", "key", "name", "patterns",
                 "mesh", "collectives", "orders")

    def __init__(self, signature, outputs, scalar_types, kind, guarded=(), constants=None):
        self.structure = (signature, outputs, scalar_types, tuple(guarded), constants)
        self.executables = {}
        self.orders = {}  # donation pattern -> _Order
        self.has_checks = None  # known once traced
        self.kind = kind
        self.key = structure_key(*self.structure)
        names = [c.fn.name for c, _, _ in signature[:1] + signature[-1:] if hasattr(c.fn, "name")]
        self.name = f"segment of {len(signature)} ops ({' .. '.join(names)})"
        self.patterns = None  # donation patterns built, here or by earlier processes
        # Collectives: the program runs on every rank of their group (spmd.py).
        self.mesh = next((c.mesh for c, _, _ in signature if c.mesh is not None), None)
        self.collectives = [c.collective for c, _, _ in signature if c.collective is not None]

    @classmethod
    def from_recording(cls, recorded, kind, outputs=None, guarded=(), baked=False):
        """The segment of a Recording (recording.py) giving the values of slots `outputs`
        (None: every value that storages still hold); `baked`: its Python numbers are
        constants of the program (see `baked_numbers`)."""
        if outputs is None:
            outputs = recorded.output_slots()
        types = recorded.scalar_types
        return cls(recorded.signature, outputs, types, kind, guarded,
                   baked_numbers(recorded.scalars, types) if baked else None)

    def learn_checks(self, ext_arrays, packed_scalars):
        """Trace the segment abstractly the first time it is seen: whether its ops check
        indices is known only from a trace, and must be known before the first executable is
        built, or that one could not donate and a second one would be compiled at once."""
        if self.has_checks is None:
            self.has_checks = executables.recall("checks", self.key)
        if self.has_checks is None:
            self.has_checks = self._trace_checks(ext_arrays, packed_scalars)
            executables.remember("checks", self.key, self.has_checks)

    def _trace_checks(self, ext_arrays, packed_scalars):
        self._make((False,) * len(ext_arrays)).eval_shape([], ext_arrays, packed_scalars)
        return any(c.check_info for c, _, _ in self.structure[0])

    def _make(self, donate):
        """The (unbuilt) executable of this donation pattern."""
        function = segment_function(*self.structure, self.order(donate))
        key = None if self.key is None else f"{self.key} donating {donate}"
        options = dict(traced=checks_info(self.structure[0]), compiler_options=EAGER_ROUNDING,
                       donate_argnums=(0,) if any(donate) else ())
        if self.mesh is not None:
            # Where the ranks disagree, the ops before the first collective only (spmd.Program)
            ops = self.structure[0]
            first = next((i for i, (c, _, _) in enumerate(ops) if c.collective is not None), len(ops))
            until = segment_function(*self.structure, self.order(donate), stop=first)
            return spmd.Program(function, self.mesh, self.collectives, key, self.name,
                                self.name, skipped=until, **options)
        return executables.Executable(function, key, self.name, **options)

    def order(self, donate):
        """The argument and result order of this donation pattern's executable (_Order)."""
        order = self.orders.get(donate)
        if order is None:
            signature, outputs, _, guarded, _ = self.structure
            order = self.orders[donate] = _Order(
                donate, guarded + _overwrites(signature, outputs), len(outputs))
        return order

    def donation(self, ext_arrays, held=None):
        """Per input array: may the segment consume it?  Only arrays nothing else refers to
        (see `unshared`), and where an index check can fail only if the program keeps the
        storages it overwrites (`guarded`: graphs); a fused segment's failure is replayed from
        intact inputs instead."""
        if self.has_checks is not False and not self.structure[3]:
            return (False,) * len(ext_arrays)
        return unshared(ext_arrays, held)

    def prebuild(self, ext_arrays, donate, packed_scalars):
        """Start building the executable of this donation pattern (traced here, so what the
        lowerings refuse raises here; compiled on a thread of its own, or loaded), before its
        first run, which waits for it."""
        start = time.perf_counter()
        fn = self._make(donate)
        with donation_warnings_ignored():
            async_compile.prebuild(fn, (*self.order(donate).split(ext_arrays), packed_scalars),
                                   ahead=True)
        self.executables[donate] = fn
        self.has_checks = any(c.check_info for c, _, _ in self.structure[0])
        metrics.counters[f"{self.kind}_compiles"] += 1
        metrics.counters["compile_seconds"] += time.perf_counter() - start

    def prepare(self, ext_arrays, packed_scalars, held=None):
        """Everything before running: learn the checks, choose the donation and compile its
        executable if new (a compile is the long part of a first run, and an interrupted one
        consumes nothing).  An error here is left to `run`, which fails the same way.
        Returns the call to hand to `run`."""
        start = time.perf_counter()
        try:
            self.learn_checks(ext_arrays, packed_scalars)
        except Exception:
            pass
        donate = self.choose(self.donation(ext_arrays, held))
        compiling = donate not in self.executables
        try:
            self.compile(ext_arrays, donate, packed_scalars)
        except Exception:
            pass
        return donate, compiling, start

    def choose(self, donate):
        """The donation pattern to run with, given what `donate` allows: itself if built (here
        or by an earlier process), else the built one donating the most of it (donating less
        is always correct, and cheaper than compiling), else itself (built now).  Which inputs
        are free to donate depends on who else holds them, which a restart can change."""
        if donate in self.executables:
            return donate
        if self.patterns is None:
            self.patterns = set(executables.recall("donations", self.key) or ())
        if donate in self.patterns:
            return donate
        usable = [p for p in self.patterns if len(p) == len(donate)
                  and all(d or not q for q, d in zip(p, donate))]
        return max(usable, key=sum) if usable else donate

    def compile(self, ext_arrays, donate, packed_scalars):
        """The executable for this donation pattern, compiled if new."""
        fn = self.executables.get(donate)
        if fn is None:
            fn = self._make(donate)
            with donation_warnings_ignored():
                fn.prepare(*self.order(donate).split(ext_arrays), packed_scalars)
            self.executables[donate] = fn
            if self.patterns is not None and donate not in self.patterns:
                # With those another process noted meanwhile (a lost race only costs a compile).
                self.patterns |= {donate, *map(tuple, executables.recall("donations", self.key) or ())}
                executables.remember("donations", self.key, sorted(self.patterns))
        return fn

    def run(self, ext_arrays, call, packed_scalars):
        """(results, checks): `checks`, the ops' device-side checks, are not read here: the
        caller queues them with sync.defer and `check_error`."""
        donate, compiling, start = call
        try:
            fn = self.compile(ext_arrays, donate, packed_scalars)
            order = self.order(donate)
            donated, kept = order.split(ext_arrays)
            with donation_warnings_ignored():
                results, checks = fn(donated, kept, packed_scalars)
            if order.back is not None:
                results = [results[p] for p in order.back]
            metrics.counters["donated_buffers"] += len(donated)
        finally:
            if compiling:
                metrics.counters[f"{self.kind}_compiles"] += 1
                metrics.counters["compile_seconds"] += time.perf_counter() - start
            else:
                metrics.counters[f"{self.kind}_cache_hits"] += 1
        return results, checks

    def check_error(self, where, note):
        """For sync.defer: error(host values of run's checks), the first failed op's error
        naming it and its line (`where`: per op, its kernel and line), or None."""
        signature = self.structure[0]

        def error(values):
            i = first_failed_check(values)
            if i is None:
                return None
            kernel, line = where[i]
            return debug.failed_check(values[i], signature[i][0], kernel.overload, line, note)
        return error

    def lower(self, ext_arrays, packed_scalars):
        return self._make((False,) * len(ext_arrays)).lower([], ext_arrays, packed_scalars)

    def compile_for(self, target, ext_arrays, packed_scalars, donate):
        """The program of this donation pattern compiled for a TPU target
        (tpu_compiler.Report), as it is built to run here."""
        return self._make(donate).compile_for(
            target, *self.order(donate).split(ext_arrays), packed_scalars)

    def export(self, ext_arrays, packed_scalars, platforms):
        """StableHLO text of the program for `platforms` (spmd.export), whose devices this
        process need not have; a segment without collectives is one device's program."""
        function = segment_function(*self.structure, self.order((False,) * len(ext_arrays)))
        args = ([], ext_arrays, packed_scalars)
        if self.mesh is not None:
            return spmd.export(function, self.mesh.devices.size, args, platforms)
        return jax.export.export(jax.jit(function), platforms=platforms)(
            *spmd.described(args)).mlir_module()


@contextlib.contextmanager
def donation_warnings_ignored():
    # Donating a freed array that no output can reuse is harmless; JAX warns anyway.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        yield


def unshared(arrays, held=None):
    """Per array: does nothing but the list `arrays` refer to it (and, where `held[k]`, the one
    storage the caller overwrites with the results)?  Such an array may be donated: its memory
    can hold a result.  References counted: the list, the loop variable, getrefcount's argument."""
    counts = [sys.getrefcount(a) for a in arrays]  # (zip would hold one more reference)
    return tuple(c <= 3 + h for c, h in zip(counts, held or (0,) * len(arrays)))


class _Order:
    """How a segment's executable takes its inputs and gives its results, for one donation
    pattern.  JAX gives a donated input's buffer to the first result of its shape and dtype,
    in order; a result that overwrites a donated input (`overwrites`: (result, input) pairs,
    a parameter's or an optimizer state's new value; `_overwrites`, and a graph's `guarded`)
    must get that input's buffer, or XLA copies the input first (where a gradient of a
    parameter's shape came first and took the parameter's buffer, it copied every parameter
    and optimizer state: 150 copies in the small GPT's whole step; given to an unrelated
    result, FSDP2's fused backward read a wrong gradient on XLA:CPU).  So those results come
    first, and their inputs first among the donated ones, in the same order.
    `inputs`: per external input, its position in (donated + kept); `results`: the segment's
    results in the executable's order; `back` (None where that is the segment's order): per
    segment result, its position among the executable's."""

    __slots__ = ("donated", "kept", "inputs", "results", "back")

    def __init__(self, donate, overwrites, n_results):
        pairs, ahead = {}, set()
        for r, k in overwrites:  # (one result per input, one input per result)
            if donate[k] and k not in pairs and r not in ahead:
                pairs[k] = r
                ahead.add(r)
        pairs = sorted(pairs.items())
        first = {k for k, _ in pairs}
        self.donated = [k for k, _ in pairs] + [k for k, d in enumerate(donate) if d and k not in first]
        self.kept = [k for k, d in enumerate(donate) if not d]
        self.inputs = [0] * len(donate)
        for p, k in enumerate(self.donated + self.kept):
            self.inputs[k] = p
        self.results = [r for _, r in pairs] + [r for r in range(n_results) if r not in ahead]
        self.back = None
        if self.results != list(range(n_results)):
            self.back = [0] * n_results
            for p, r in enumerate(self.results):
                self.back[r] = p

    def split(self, ext_arrays):
        """(donated, kept): the two argument lists of the executable."""
        return [ext_arrays[k] for k in self.donated], [ext_arrays[k] for k in self.kept]


def segment_function(signature, outputs, scalar_types, guarded, constants, order, stop=None):
    """The recorded ops as one JAX function: (donated, kept, packed scalars) -> (results, each
    op's checks), arguments and results in `order` (_Order).  `guarded`: (result, input) pairs,
    the storages a graph overwrites: where a check fails, result r is input k unchanged, so a
    failure read later changed nothing.  `constants` (`baked_numbers`, or None): the numbers that are
    constants of the program rather than read from `packed`.  `stop`: run the ops before op
    `stop` only, as strict eager would have before an op that raised: each storage a later op
    writes keeps the value it had then, one a later op makes is zeros, their checks pass; the
    function then takes the whole segment's (results, checks) shapes first (what a rank runs
    where the ranks disagree on the segment's collectives: spmd.Program)."""
    if stop is not None:
        before = _overwritten(signature)

    def segment(donated, kept, packed):
        return run(donated, kept, packed, None)

    def until(shapes, donated, kept, packed):
        return run(donated, kept, packed, shapes)

    def run(donated, kept, packed, shapes):
        given = list(donated) + list(kept)
        ext = [given[p] for p in order.inputs]
        scalars = _unpack_scalars(packed, scalar_types)
        if constants is not None:
            scalars = _with_constants(scalars, scalar_types, constants, signature)
        slots = []
        checks = []
        pos = 0
        for compiled, wiring, n_scalars in signature[:stop]:
            ins = wired(wiring, slots, ext)
            outs, updated, op_checks = compiled.run(*ins, *scalars[pos:pos + n_scalars])
            pos += n_scalars
            slots.extend(_rounded_half(outs))
            slots.extend(_rounded_half(updated))
            checks.append(op_checks)
        if stop is None:
            results = [slots[s] for s in outputs]
        else:
            wanted, checked = shapes
            if order.back is not None:
                wanted = [wanted[p] for p in order.back]
            results = [_as_of(s, slots, before, ext, w) for s, w in zip(outputs, wanted)]
            checks.extend(jax.tree_util.tree_map(lambda c: jnp.ones(c.shape, c.dtype),
                                                 checked[stop:]))
        passed = all_passed(checks)
        if guarded and passed is not None:
            for r, k in guarded:
                results[r] = jnp.where(passed.all(), results[r], ext[k])
        if order.back is not None:
            results = [results[r] for r in order.results]
        return results, checks

    return segment if stop is None else until


def _overwritten(signature):
    """Per slot: the slot or external input (< 0) whose storage it overwrites, or None."""
    before = []
    for compiled, wiring, _ in signature:
        before.extend([None] * len(compiled.wrap_specs))
        before.extend(wiring[j] if type(wiring[j]) is int else None for j in compiled.writes)
    return before


def _overwrites(signature, outputs):
    """(result, external input) pairs: the result is the new value of the input's storage
    (after one or more in-place ops), so a donated input's buffer is its own (_Order)."""
    before = _overwritten(signature)
    pairs = []
    for r, slot in enumerate(outputs):
        while slot is not None and slot >= 0:
            slot = before[slot]
        if slot is not None:
            pairs.append((r, -1 - slot))
    return tuple(pairs)


def _as_of(slot, slots, before, ext, shape):
    """The value of the storage that `slot` is a value of, as of the ops run (`slots`): the
    slot's own, or what it overwrote, back to the external input; zeros where it was made
    later."""
    while slot is not None and slot >= len(slots):
        slot = before[slot]
    zeros = jnp.zeros(shape.shape, shape.dtype)
    if slot is None:
        return zeros
    value = slots[slot] if slot >= 0 else ext[-1 - slot]
    if value.shape != shape.shape or value.dtype != shape.dtype:
        return zeros
    return value


def _with_constants(scalars, scalar_types, constants, signature):
    """`scalars` with the baked numbers in place of the packed ones: the views' offsets (the
    last `n_offsets` numbers of an op) as Python ints, so strided.py slices statically; the
    others as weakly typed constants of their packed dtype, so they promote as the packed
    values did."""
    scalars = list(scalars)
    offsets = set()
    pos = 0
    for compiled, _, n_scalars in signature:
        n = getattr(compiled, "n_offsets", 0)
        offsets.update(range(pos + n_scalars - n, pos + n_scalars))
        pos += n_scalars
    for i, (v, t) in enumerate(zip(constants, scalar_types)):
        if v is None:
            continue
        scalars[i] = int(v) if i in offsets else (
            np.asarray(v, np.bool_) if t is bool else as_weak(np.asarray(v, _packed_type(t))))
    return scalars



def wired(wiring, slots, ext):
    """An op's inputs: an earlier op's result (slot >= 0), an external array (< 0) or zeros
    (size or shape, and dtype name: _settle_zeros)."""
    return [(slots[w] if w >= 0 else ext[-1 - w]) if type(w) is int else _zeros(*w)
            for w in wiring]


def _zeros(shape, dtype):
    return jnp.zeros(shape, dtype)


def all_passed(checks):
    """Every check of a segment's ops as one boolean vector (None: no checks), traced."""
    flat = [c for op in checks for c in op]
    return jnp.stack([jnp.asarray(c, bool).reshape(()) for c in flat]) if flat else None


def first_failed_check(checks):
    if not any(checks):
        return None
    for i, op_checks in enumerate(jax.device_get(checks)):
        if op_checks and not all(bool(c) for c in op_checks):
            return i
    return None

