"""Executables that a later process loads instead of building: no trace, no lowering, no XLA.

Every path compiles through `Executable`, a `jax.jit` that keeps one executable per argument
signature: strict eager's per-op executables (`op_programs`), fused segments and compiled graphs
(`segment.Segment`).  On a miss in memory it looks in the persistent store (`_core/cache_store.py`,
installed by `persistent_cache.enable()`) under a key made of
  - what the caller keys the program on in memory (an op: its overload, static arguments and
    input layouts; a segment: its ops' keys, wiring and outputs, and the donated inputs),
  - the argument signature (shapes, dtypes, weak types, placement of every array),
  - `fingerprint()`: torch/jax/jaxlib/torchtpu versions, a digest of torchtpu's own source (a
    lowering edited without a version bump is another program), platform, device kind, JAX's
    configuration (x64, matmul precision, ...), XLA_FLAGS and TORCHTPU_* settings;
a key that names an unstable value (an object's address) is never stored.  An entry holds the
serialized executable and what its trace would have told (an op's index-check messages).  A
missing, corrupt, foreign or unloadable entry is a miss: the program is built as usual and
the entry rewritten.  Entries are written by a background thread, so a first run does not wait
for its disk; one file per executable (a GPT step's ~80 per-op entries take ~8 KB each and
load in ~1 ms, so packing them would not pay).

`torchtpu.metrics()` splits the time: trace_seconds, lower_seconds, xla_compile_seconds and
cache_load_seconds, with executables_compiled / executables_loaded; `metrics.builds` keeps,
per program, the signatures it was built for, which the report lists for those built twice.
"""
import concurrent.futures
import functools
import hashlib
import os
import pickle
import sys
import threading
import time

import jax
import torch

from .._core import metrics, runtime, tpu_compiler, version

_FORMAT = 3
_store = None
_static = None
_writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchtpu-cache-writer")
# Settings that only say where or how much to cache: they do not change a program.
_NOT_PROGRAM = ("TORCHTPU_CACHE_DIR", "TORCHTPU_CACHE_MAX_BYTES", "TORCHTPU_METRICS",
                "TORCHTPU_COMPILE_WORKERS")


_local = threading.local()
_counters_lock = threading.Lock()


def compiling_ours():
    """Whether this thread is compiling an Executable's program.  JAX's own persistent cache
    must then neither serve it nor store it: XLA:CPU drops functions when it serializes an
    executable that it deserialized (the entry we would write from JAX's copy fails to run
    with "Function ... not found"), and an entry of ours already holds the program."""
    return getattr(_local, "ours", False)


def use_store(store):
    """Keep executables in `store` (a PrivateCache), or nowhere (None)."""
    global _store
    _store = store


def _source_digest():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the torchtpu package
    h = hashlib.sha256()
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def fingerprint():
    """What, besides its own key, decides the program an executable is (see the docstring)."""
    global _static
    if _static is None:
        import jaxlib
        devices = jax.devices()
        env = sorted((k, v) for k, v in os.environ.items()
                     if (k.startswith("TORCHTPU_") and k not in _NOT_PROGRAM)
                     or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS"))
        _static = repr((
            _FORMAT, sys.version_info[:2], torch.__version__, jax.__version__, jaxlib.__version__,
            version.VERSION, _source_digest(),
            devices[0].platform, devices[0].client.platform_version,
            [(d.id, d.device_kind) for d in devices], jax.process_count(),
            # this process's devices: a program whose inputs do not name a device runs on
            # the first of them, which differs between the processes of one job
            [d.id for d in jax.local_devices()], env))
    # Settings that can change at any time (jax.config.update, context managers, torch's
    # defaults that some lowerings read while tracing).
    flags = sorted((name, repr(holder.value)) for name, holder in jax.config._value_holders.items()
                   if "cache" not in name and "log" not in name)
    return _static + repr((flags, torch.get_default_dtype(), torch.get_float32_matmul_precision(),
                           torch.get_num_threads()))


def stable(value):
    """`repr(value)` when it names the value the same way in every process, else None."""
    text = repr(value)
    return None if " at 0x" in text or "object at" in text else text


def _leaf_signature(x):
    if isinstance(x, jax.Array):
        return (tuple(x.shape), str(x.dtype), x.aval.weak_type, repr(x.sharding))
    if isinstance(x, jax.ShapeDtypeStruct):  # an array still being computed (async_compile)
        return (tuple(x.shape), str(x.dtype), x.weak_type, repr(x.sharding))
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy
        return (type(x).__name__, tuple(x.shape), str(x.dtype))
    return type(x).__name__


def _aval(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
    return jax.typeof(x)


def _devices(x):
    sharding = getattr(x, "sharding", None)  # None: a Python number, placed with the others
    return None if sharding is None else sharding.device_set


def _shapes(args):
    """What tells the signatures an executable is called with apart, cheaply."""
    return tuple([getattr(a, "shape", None) for a in args])


MISS = object()  # Executable.call_built: no executable built for such arguments


def signature(args):
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (str(tree), tuple(_leaf_signature(x) for x in leaves))


class Executable:
    """`jax.jit(fn, **options)` built once per argument signature, or loaded from the store.

    `key`: a stable text naming the program apart from its arguments (None: never stored);
    `name`: what the metrics call it; `describe`: the signature in words, for the rebuild
    report; `traced`: (save, restore) of what tracing learns besides the program (an op's
    index-check messages): save() is stored with the entry, restore(value) runs on a load;
    `retarget(chips)`: fn for a TPU target's chips, where fn names this process's devices (a
    shard_map over a process group's mesh)."""

    __slots__ = ("jitted", "key", "name", "describe", "traced", "last", "by_shapes", "built",
                 "lock", "compiling", "fn", "options", "retarget")

    def __init__(self, fn, key, name, describe=None, traced=None, retarget=None, **options):
        # Unused arguments kept: a program's results are placed where its arguments are, and
        # one whose results read none of them (a fill_ of a whole storage, its input dropped)
        # placed them on the default device, not the one its inputs, its op's, are on: a
        # process using tpu:1 (torch.tpu.set_device(LOCAL_RANK)) got torch.ones on tpu:0's chip.
        self.jitted = jax.jit(fn, **{"keep_unused": True, **options})
        # (a TPU target's build: compile_for, tpu_compiler.alongside)
        self.fn, self.options, self.retarget = fn, options, retarget
        self.key = key
        self.name = name
        self.describe = describe
        self.traced = traced
        # The executable of the latest signature used, and per shapes of the arguments the
        # latest used on them with its signature: the call's fast path (a chain of ops that
        # starts from a flat storage, e.g. randn's, then goes on with shaped ones).
        self.last = None
        self.by_shapes = {}
        self.built = {}    # signature -> jax.stages.Compiled
        self.compiling = {}  # signature -> Future of the Compiled, while a worker builds it
        self.lock = threading.Lock()

    def __call__(self, *args):
        out = self.call_built(args)
        return self.prepare(*args)(*args) if out is MISS else out

    def call_built(self, args):
        """Run the executable last used on arguments of these shapes (the call's fast path:
        a DDP bucket's views of one shape in buckets of two sizes alternate between two), or
        MISS where there is none or JAX refuses `args` (another signature: refused before
        running anything, another dtype a TypeError, another device a ValueError).  An error
        of the program itself (XLA:CPU's gloo reports a lost peer as a ValueError) raises."""
        hit = self.by_shapes.get(_shapes(args))
        if hit is None:
            return MISS
        try:
            return hit[0](*args)
        except (TypeError, ValueError):
            if signature(args) == hit[1]:
                raise  # it ran, and failed
            return MISS

    def has(self, *args):
        return signature(args) in self.built

    def compile_for(self, target, *args):
        """This program on these arguments compiled for a TPU target (tpu_compiler.Report)."""
        fn = self.fn if self.retarget is None else self.retarget(tpu_compiler.topology(target))
        return tpu_compiler.compile_for(tpu_compiler.retargeted(fn, self.options), args,
                                        target, self.name)

    def lower(self, *args):
        return self.jitted.lower(*args)

    def eval_shape(self, *args):
        return jax.eval_shape(self.jitted, *args)

    def prepare(self, *args):
        """The executable for these arguments' signature, built or loaded if new."""
        sig = signature(args)
        compiled = self.built.get(sig)
        if compiled is None:
            compiled = self._start(args, sig, pool=None)
            if isinstance(compiled, concurrent.futures.Future):
                compiled = compiled.result()
        self._use(compiled, sig, args)
        return compiled

    def _use(self, compiled, sig, args):
        self.last = compiled
        self.by_shapes[_shapes(args)] = (compiled, sig)

    def start(self, args, pool):
        """The executable for `args` (arrays, or `jax.ShapeDtypeStruct`s of arrays still being
        computed) if it is built or in the store; else trace it on this thread (so an error
        of the lowering raises at the call) and return a Future of its lowering and XLA
        compile on `pool`."""
        sig = signature(args)
        compiled = self.built.get(sig) or self._accepting(args)
        if compiled is None:
            return self._start(args, sig, pool)
        if not isinstance(compiled, concurrent.futures.Future):
            self._use(compiled, sig, args)
        return compiled

    def _accepting(self, args):
        """An executable, built or being built, that JAX would run on `args` though their
        signature differs: it was built for a Python float where these hold a weakly typed
        scalar array (strict eager passes a number the first time it sees it and a device
        array after), which the fast path of __call__ accepts too."""
        if not (self.built or self.compiling):
            return None
        leaves = jax.tree_util.tree_leaves(args)
        avals = [_aval(a) for a in leaves]
        devices = [_devices(a) for a in leaves]
        for candidate in list(self.built.values()) + list(self.compiling.values()):
            if isinstance(candidate, concurrent.futures.Future):
                their_avals, their_devices = candidate.in_avals, candidate.devices
            else:
                their_avals = jax.tree_util.tree_leaves(candidate.in_avals)
                their_devices = [s.device_set for s in jax.tree_util.tree_leaves(candidate.input_shardings)]
            if their_avals == avals and all(d is None or e is None or d == e
                                            for d, e in zip(devices, their_devices)):
                return candidate
        return None

    def _start(self, args, sig, pool):
        with self.lock:
            compiled = self.built.get(sig) or self.compiling.get(sig)
            if compiled is not None:
                return compiled
            entry_key = None
            if _store is not None and self.key is not None:
                digest = hashlib.sha256(f"{fingerprint()}\n{self.key}\n{sig!r}".encode()).hexdigest()
                entry_key = f"torchtpu-{self.name.split('(')[0][:40]}-{digest}"
                compiled = self._load(entry_key)
                if compiled is not None:
                    self._note_build(sig, args, loaded=True)
                    self._keep(sig, compiled)
                    return compiled
            counters = metrics.counters
            t0 = time.perf_counter()
            traced = self.jitted.trace(*args)
            counters["trace_seconds"] += time.perf_counter() - t0
            counters["executables_compiled"] += 1
            self._note_build(sig, args, loaded=False)
            if pool is None:
                compiled = self._compile(traced, sig, entry_key)
                self._keep(sig, compiled)
                return compiled
            # Lowered by the worker too: what the lowering refuses, the trace already raised.
            future = self.compiling[sig] = pool.submit(self._compile_in_worker, traced, sig, entry_key)
            future.out_info = traced.out_info  # what its results will be, known before they are
            future.in_avals = jax.tree_util.tree_leaves(traced.in_avals)  # see _accepting
            future.devices = [_devices(a) for a in jax.tree_util.tree_leaves(args)]
            return future

    def _keep(self, sig, compiled):
        self.built[sig] = compiled
        if self.last is None:
            self.last = compiled

    def _compile_in_worker(self, traced, sig, entry_key):
        try:
            compiled = self._compile(traced, sig, entry_key)
            with self.lock:
                self._keep(sig, compiled)
        finally:
            self.compiling.pop(sig, None)
        return compiled

    def _compile(self, traced, sig, entry_key):
        if runtime.platform() == "tpu":  # what libtpu would abort on is refused first
            tpu_compiler.check_compilable(traced.jaxpr, self.name)
        t0 = time.perf_counter()
        lowered = traced.lower()
        t1 = time.perf_counter()
        _local.ours = True
        try:
            compiled = lowered.compile()
        finally:
            _local.ours = False
        with _counters_lock:  # workers compile at once
            metrics.counters["lower_seconds"] += t1 - t0
            metrics.counters["xla_compile_seconds"] += time.perf_counter() - t1
        if entry_key is not None:
            extra = None if self.traced is None else self.traced[0]()
            _writer.submit(_save, _store, entry_key, compiled, extra, lowered)
        return compiled

    def _load(self, entry_key):
        counters = metrics.counters
        start = time.perf_counter()
        data = _store.get(entry_key)
        if data is None:
            counters["executable_cache_misses"] += 1
            return None
        try:
            fmt, payload, in_tree, out_tree, extra, device_ids = pickle.loads(data)
            if fmt != _FORMAT:
                raise ValueError(f"entry format {fmt}")
            # Loaded for the devices it was built for: by default JAX loads an executable
            # onto every device of the backend, which mismatches its single-device inputs
            # ("Expected args ... to have 4 shards") and, across processes, gives arrays that
            # no other program accepts.
            by_id = {d.id: d for d in jax.devices()}
            from jax.experimental import serialize_executable
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except Exception:  # noqa: BLE001 - an entry that does not load is rebuilt, whatever broke
            counters["executable_cache_rejected"] += 1
            return None
        if self.traced is not None:
            self.traced[1](extra)
        counters["executables_loaded"] += 1
        counters["cache_load_seconds"] += time.perf_counter() - start
        return compiled

    def _note_build(self, sig, args, loaded):
        what = self.describe() if self.describe is not None else _describe_signature(sig)
        metrics.note_build(self.name, what + (" (loaded)" if loaded else ""))
        tpu_compiler.alongside(self.compile_for, args)  # inside torch.tpu.compile_for(target)


def _describe_signature(sig):
    return " ".join(f"{s[1]}{list(s[0])}" if isinstance(s, tuple) and len(s) == 4 else str(s)
                    for s in sig[1])


def _save(store, entry_key, compiled, extra, lowered):
    # Not stored with a custom call (LAPACK's, ...): XLA:CPU runs such an executable after
    # deserializing it into a segfault (linalg.inv from a warm cache).  Looked for here, on
    # the writer's thread: printing a large program takes the compiling thread's time.
    if "custom_call" in lowered.as_text():
        return
    try:
        from jax.experimental import serialize_executable
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
        data = pickle.dumps((_FORMAT, payload, in_tree, out_tree, extra, device_ids))
        store.put(entry_key, data)
    except Exception:  # noqa: BLE001 - not every executable serializes; it is then not kept
        metrics.counters["executable_cache_unsaved"] += 1


def _fact_key(name, key):
    return f"torchtpu-fact-{name}-" + hashlib.sha256(f"{fingerprint()}\n{key}".encode()).hexdigest()


def recall(name, key):
    """A small value noted about a program named by `key` (from tracing it, or which variants
    of it were built), by this or an earlier process; None if not known."""
    if _store is None or key is None:
        return None
    data = _store.get(_fact_key(name, key))
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:  # noqa: BLE001 - an unreadable entry is a miss
            metrics.counters["executable_cache_rejected"] += 1
    return None


def remember(name, key, value):
    if _store is not None and key is not None:
        _writer.submit(_store.put, _fact_key(name, key), pickle.dumps(value))


def wait_for_writes():
    """Block until every entry queued so far is written (tests, benchmarks)."""
    _writer.submit(lambda: None).result()


@functools.lru_cache(maxsize=256)
def zeros(shape, dtype, index):
    """The executable making zeros of `shape` on a device, for a storage read before it was
    written (storage.use_zeros_executable); bounded: one per storage size would otherwise grow
    without end."""
    import jax.numpy as jnp
    return Executable(lambda: jnp.zeros(shape, dtype), stable(("zeros", shape, str(dtype), index)),
                      "zeros", out_shardings=jax.sharding.SingleDeviceSharding(runtime.jax_device(index)))


@functools.lru_cache(maxsize=32)
def scalar(kind, index):
    """The executable putting a Python number (`kind`: int or float) on a device as the weakly
    typed 0-d array a jitted function makes of it (op_keys.device_scalar).  jnp.asarray
    compiles a conversion program per dtype in every process (50-80 ms of a restart, which
    otherwise loads everything); this one is loaded from the store."""
    return Executable(lambda v: v, stable(("scalar", kind.__name__, index)), "scalar",
                      out_shardings=jax.sharding.SingleDeviceSharding(runtime.jax_device(index)))


@functools.lru_cache(maxsize=64)
def capacity(n):
    """The executable giving an array's elements, flat, in an array of n (the growing
    sequences of growing_sequences.py); the elements past the array's are never read."""
    import jax.numpy as jnp
    return Executable(lambda a: jnp.pad(a.reshape(-1), (0, n - a.size)),
                      stable(("capacity", n)), "capacity")
