"""Our programs compiled for a TPU slice this machine need not have, and what the compiler says.

libtpu's compiler runs without a TPU: `jax.experimental.topologies.get_topology_desc` gives
compile-only devices of a named slice ("v5e:1x1", "v6e:2x2", "v5p:2x2x1", "v5e:16x16"), and a
`jax.jit` traced on arrays placed on them lowers and compiles for that slice.  The result is
the program a TPU would run: its HBM per chip (`memory_analysis`), its roofline
(`cost_analysis()["optimal_seconds"]`), and its TPU-scheduled HLO.  `compile_for(fn, args,
target)` does that for any jitted function of ours and its (CPU) arguments, moving each
argument's placement onto the target's devices; `Report` holds what a user checks before
renting the slice.  The context (`targeting`) and the hook `alongside` make every program
built meanwhile (strict ops, fused segments, compiled graphs, captured steps) compile for the
target too (executables.Executable calls `alongside`).

Facts of libtpu 0.0.42 (jax 0.10.2) this relies on, measured here:
- a 1x1 slice needs `chips_per_host_bounds=[1, 1, 1]`;
- `optimal_seconds` counts every `X64Split*`/`X64Combine`/`ConcatBitcast` custom call as -1 s
  (a program with 3 of them and nothing else reports -3.0), and on v6e the
  `PrepareAsyncCallStart`/`Done` pair around a scatter offloaded to the SparseCore (JAX's
  8B FSDP step, one layer: -1.96 s); they are added back, which leaves the roofline of a
  program with n of them precise to about n x 0.5 us (a float32's rounding at n seconds), and
  the offloaded scatter uncosted;
- of a `conditional` it costs only the first branch (its -1 s calls too; measured: a fused
  FSDP2 segment's entry, first and second branch hold 8, 2 and 5 such calls, and it counted
  10): a program whose work sits in another branch reports little more than its entry's
  (until 2026-12-05, every program over a process group: its step behind the ranks' check,
  now made on the host beside it, spmd.py); `Report.branches_costed` says so;
- compile-only devices have no memory statistics: a chip's HBM is this file's table, and a
  program that does not fit fails to compile with RESOURCE_EXHAUSTED (reported, not raised).
"""
import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import re
import threading
import time

import jax
import numpy as np

# Per chip, by JAX's device_kind: its name in topologies and its HBM bytes (Cloud TPU's
# published figures; compile-only devices have no memory statistics).
CHIPS = {
    "TPU v4": ("v4", 32 * 2**30),
    "TPU v5 lite": ("v5e", 16 * 2**30),
    "TPU v5": ("v5p", 95 * 2**30),
    "TPU v6 lite": ("v6e", 32 * 2**30),
}
# Custom calls libtpu's cost model counts as -1 s each (see above): 64-bit integer emulation,
# the bitcast that concatenates a sliced copy, and the pair that starts a scatter offloaded to
# v6e's SparseCore.
_NEGATIVE_COST_CALLS = ("X64SplitLow", "X64SplitHigh", "X64Combine", "ConcatBitcast",
                        "PrepareAsyncCallStart", "PrepareAsyncCallDone")
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def have_libtpu():
    """Whether libtpu's compiler is installed (`pip install torchtpu[tpu]` or `libtpu`)."""
    from jax._src import cloud_tpu_init
    return cloud_tpu_init.get_tpu_library_path() is not None


@functools.lru_cache(maxsize=None)
def topology(target):
    """The compile-only devices of `target`, e.g. "v5e:1x1", "v6e:2x2", "v5p:2x2x1"."""
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"a TPU target is named like 'v5e:1x1' or 'v5p:2x2x1', got {target!r}")
    if not have_libtpu():
        raise RuntimeError("compiling for a TPU target needs libtpu: pip install 'torchtpu[tpu]' "
                           "(or `pip install libtpu`); no TPU is needed")
    from jax.experimental import topologies
    bounds = target.split(":", 1)[1].split("x")
    single = all(b == "1" for b in bounds)
    options = {"chips_per_host_bounds": [1, 1, 1]} if single else {}
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # a TPU-less host: no lock needed
    with _quiet_stderr():
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=target, **options)
        except Exception as e:  # noqa: BLE001 - libtpu's own words, with the name it refused
            raise ValueError(f"libtpu does not know the TPU target {target!r}: {e}") from None
    return topo.devices


@contextlib.contextmanager
def _quiet_stderr():
    """libtpu prints what it could not learn of the host (TPU_ACCELERATOR_TYPE, worker
    hostnames) to the process's stderr when it loads; meaningless for a compile-only target,
    so hidden unless TORCHTPU_VERBOSE_LIBTPU=1."""
    if os.environ.get("TORCHTPU_VERBOSE_LIBTPU") == "1":
        yield
        return
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _target_sharding(sharding, devices):
    """`sharding` (over this process's devices) moved onto the target's `devices`: the same
    mesh shape, axis names and partition over the first devices of the target."""
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    if isinstance(sharding, NamedSharding):
        n = sharding.mesh.devices.size
        if n > len(devices):
            raise ValueError(f"the program runs on {n} devices; the target has {len(devices)}")
        mesh = Mesh(_grid(devices[:n], sharding.mesh.devices.shape), sharding.mesh.axis_names)
        return NamedSharding(mesh, sharding.spec)
    if sharding is None or isinstance(sharding, SingleDeviceSharding) or len(sharding.device_set) == 1:
        return SingleDeviceSharding(devices[0])
    raise TypeError(f"cannot move a {type(sharding).__name__} onto a TPU target")


def _grid(devices, shape):
    import numpy as np
    return np.array(devices, dtype=object).reshape(shape)


def target_args(args, devices):
    """`args` (arrays, ShapeDtypeStructs, Python numbers, in any pytree) as ShapeDtypeStructs
    placed on the target's devices; numbers stay numbers (traced as JAX traces them).  A host
    (numpy) array goes where the program runs: replicated over the mesh of its first mesh-sharded
    argument (a program over a process group's ranks packs its scalars in one), else the first
    chip."""
    from jax.sharding import NamedSharding, PartitionSpec
    leaves = jax.tree_util.tree_leaves(args)
    meshed = next((x.sharding for x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding)),
                  None)
    host = (_target_sharding(None, devices) if meshed is None else
            NamedSharding(_target_sharding(meshed, devices).mesh, PartitionSpec()))

    def move(x):
        if isinstance(x, complex):  # as a TPU is given a Python complex (op_keys.narrow_complex)
            return jax.ShapeDtypeStruct((), jax.numpy.complex64, weak_type=True, sharding=host)
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            weak = x.aval.weak_type if isinstance(x, jax.Array) else x.weak_type
            return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak,
                                        sharding=_target_sharding(getattr(x, "sharding", None), devices))
        if hasattr(x, "shape") and hasattr(x, "dtype"):  # packed numbers (segment.pack_scalars)
            dtype = jax.numpy.complex64 if x.dtype == _COMPLEX128 else x.dtype
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=host)
        return x
    return jax.tree_util.tree_map(move, args)


@dataclasses.dataclass
class Report:
    """What the TPU compiler says of one program for one target (per chip)."""
    name: str
    target: str
    chip: str = ""
    error: str = ""            # the compiler's refusal (a program too large for HBM, ...)
    fits: bool = False
    compile_seconds: float = 0.0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    optimal_seconds: float = 0.0  # the compiler's roofline, corrected (module docstring)
    hbm_bytes: int = 0         # arguments + outputs - aliased + temporaries
    hbm_capacity: int = 0
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    parameters: int = 0
    outputs: int = 0
    fusions: int = 0
    copies: int = 0            # copies in the entry computation (not copy-start/done: those
                               # move a buffer between HBM and the chip's VMEM, JAX's too)
    branches_costed: bool = True  # False: the roofline leaves out a conditional's later branches
    x64_calls: int = 0         # 64-bit integer emulation (X64Split*/X64Combine)
    concat_bitcasts: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> (count, overlapped)
    # kind -> (bytes each chip sends in a ring, of which overlapped with compute)
    collective_bytes: dict = dataclasses.field(default_factory=dict)
    text: str = dataclasses.field(default="", repr=False)  # the TPU-scheduled HLO

    def as_dict(self):
        d = dataclasses.asdict(self)
        d.pop("text")
        return d

    def __str__(self):
        if self.error:
            return f"{self.name} on {self.target}: does not compile: {self.error}"
        coll = ", ".join(f"{k} {n} ({o} overlapped)" for k, (n, o) in sorted(self.collectives.items()))
        return (f"{self.name} on {self.target} ({self.chip}): HBM {self.hbm_bytes / 2**20:.1f} MiB "
                f"of {self.hbm_capacity / 2**30:.0f} GiB per chip (temporaries "
                f"{self.temp_bytes / 2**20:.1f} MiB); roofline {self.optimal_seconds * 1e3:.4g} ms"
                f"{'' if self.branches_costed else ' (of a conditional, its first branch only)'}; "
                f"{self.flops / 1e9:.3f} GFLOP, {self.bytes_accessed / 1e6:.1f} MB accessed; "
                f"{self.fusions} fusions, {self.copies} copies, {self.parameters} parameters, "
                f"{self.x64_calls} 64-bit emulations; collectives: {coll or 'none'}; "
                f"compiled in {self.compile_seconds:.1f} s")


def compile_for(jitted, args, target, name="program"):
    """Compile `jitted` (a `jax.jit` function) on `args` (this process's arrays, or their
    ShapeDtypeStructs) for `target`, and report.  A program the TPU compiler refuses (too large
    for HBM, an op it cannot lower) gives a Report with `error`, never a crash of this process
    for what libtpu reports as an error."""
    devices = topology(target)
    kind = devices[0].device_kind
    chip, capacity = CHIPS.get(kind, (kind, 0))
    report = Report(name=name, target=target, chip=chip, hbm_capacity=capacity)
    start = time.perf_counter()
    try:
        # (stderr is not hidden here: were libtpu to abort on a program, its last words are
        # the only account of why)
        with _building_for("tpu"):
            traced = jitted.trace(*target_args(args, devices))
            check_compilable(traced.jaxpr, name)
            # Pallas' Mosaic lowering asks JAX's default device its kind (the TPU generation's
            # lanes and sublanes), which here is the CPU ("Unsupported TPU device kind: cpu");
            # the program is already traced, so nothing is placed on the target's chip.
            with jax.default_device(devices[0]):
                lowered = traced.lower()
            compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - libtpu's error, reported with the program's name
        report.compile_seconds = time.perf_counter() - start
        report.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:500]}"
        return report
    report.compile_seconds = time.perf_counter() - start
    read(compiled, report)
    return report


def _jaxprs(jaxpr):
    """`jaxpr` (a Jaxpr or ClosedJaxpr) and every jaxpr nested in its equations' parameters."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                    yield from _jaxprs(v)


def check_compilable(jaxpr, name):
    """Raise TypeError where a program has what XLA:TPU cannot compile and libtpu would abort
    the process on instead of refusing: a complex128 value (there is no 128-bit complex type
    on TPU; libtpu 0.0.42.1 stops at "Unsupported CVT X{64|128} expansion" in any conversion
    to or from one).  The error comes before the compiler sees the program, as MPS refuses
    float64."""
    for j in _jaxprs(jaxpr):
        for v in itertools.chain(j.invars, j.constvars,
                                 (o for eqn in j.eqns for o in eqn.outvars)):
            if getattr(getattr(v, "aval", None), "dtype", None) == _COMPLEX128:
                raise TypeError(f"{name}: complex128 is not supported on TPU (XLA:TPU has no "
                                f"128-bit complex type). Please use complex64 instead.")


_COMPLEX128 = jax.numpy.dtype("complex128")


@contextlib.contextmanager
def _building_for(platform):
    previous = getattr(_inside, "platform", None)
    _inside.platform = platform
    try:
        yield
    finally:
        _inside.platform = previous


def building_for():
    """The platform of the target this thread is tracing a program for ("tpu"), or None: the
    lowerings that choose by platform (attention's implementation, Pallas' interpret mode,
    the CPU's own workarounds) choose for the target, so that the program compiled for it is
    the one a TPU would run, not the CPU's."""
    return getattr(_inside, "platform", None)


def read(compiled, report):
    """Fill `report` from a TPU `jax.stages.Compiled`."""
    text = compiled.as_text()
    report.text = text
    found = _custom_calls(text)
    calls = collections.Counter(call for _, call in found)
    branches = _branch_computations(text)
    costed = collections.Counter(call for computation, call in found if computation not in branches)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report.flops = float(cost.get("flops", 0.0))
    report.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    report.optimal_seconds = float(cost.get("optimal_seconds", 0.0)) + sum(
        costed[c] for c in _NEGATIVE_COST_CALLS)
    report.branches_costed = not branches
    m = compiled.memory_analysis()
    report.argument_bytes = m.argument_size_in_bytes
    report.output_bytes = m.output_size_in_bytes
    report.alias_bytes = m.alias_size_in_bytes
    report.temp_bytes = m.temp_size_in_bytes
    report.hbm_bytes = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                        + m.temp_size_in_bytes)
    report.fits = not report.hbm_capacity or report.hbm_bytes <= report.hbm_capacity
    report.outputs = len(jax.tree_util.tree_leaves(compiled.out_info))
    report.x64_calls = sum(calls[c] for c in _NEGATIVE_COST_CALLS[:3])
    report.concat_bitcasts = calls["ConcatBitcast"]
    opcodes = collections.Counter(op for _, op in entry_instructions(text))
    report.parameters = opcodes["parameter"]
    report.fusions = opcodes["fusion"]
    report.copies = opcodes["copy"]
    report.collectives = collectives(text)
    report.collective_bytes = collective_bytes(text)
    return report


def _computations(text):
    """(name, its lines) of each computation of the HLO text."""
    name, lines = None, []
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?(%[\w.-]+) ", line)
        if header and line.rstrip().endswith("{"):
            name, lines = header.group(1), []
        elif line.startswith("}") and name is not None:
            yield name, lines
            name = None
        elif name is not None:
            lines.append(line)


def _custom_calls(text):
    """(computation, target) of each custom call."""
    return [(name, call) for name, lines in _computations(text) for line in lines
            for call in re.findall(r'custom_call_target="(\w+)"', line)]


def _branch_computations(text):
    """The computations libtpu's cost model leaves out: a conditional's branches but its first,
    and everything they call (a pred's true/false form: both)."""
    calls, costed, uncosted = {}, [], []
    for name, lines in _computations(text):
        calls[name] = []
        for line in lines:
            branches = [c for group in re.findall(r"branch_computations=\{([^}]*)\}", line)
                        for c in re.findall(r"%[\w.-]+", group)]
            calls[name] += re.findall(r"(?:calls|to_apply|body|condition)=(%[\w.-]+)", line) + branches
            if " conditional(" in line:
                costed += branches[:1]
                uncosted += branches[1:] + re.findall(r"(?:true|false)_computation=(%[\w.-]+)", line)

    def reached(found):
        seen = set()
        while found:
            c = found.pop()
            if c not in seen:
                seen.add(c)
                found.extend(calls.get(c, ()))
        return seen
    return reached(uncosted) - reached(costed)


# An instruction: `%name = TYPE opcode(...)`, TYPE an array type or a tuple of them (which may
# hold `/*index=5*/` comments and layouts such as `{0:T(1024)S(1)}`); the opcode is the first
# lower-case word after a space that opens a parenthesis.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.-]+) = (.*?)\s([a-z][\w-]*)\(")


def instruction(line):
    """(name, result type, opcode) of an HLO instruction's line, or None."""
    m = _INSTRUCTION.match(line)
    return m.groups() if m else None


def entry_instructions(text):
    """(name, opcode) of each instruction of the entry computation, in schedule order."""
    start = text.index("\nENTRY")
    entry = text[start:text.index("\n}", start)]
    return [(i[0], i[2]) for i in map(instruction, entry.splitlines()[1:]) if i is not None]


_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ASYNC_HALVES = ('custom_call_target="AsyncCollectiveStart"', 'custom_call_target="AsyncCollectiveDone"')


def _arrays(shape_text):
    """Bytes of each array of an HLO result type ("bf16[4096,128]{...}" or a tuple of them)."""
    found = []
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
        size = _ITEM_BYTES.get(dtype)
        if size is not None:
            found.append(size * int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return found


def _group_size(line):
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", line)
    if iota:
        return int(iota.group(1))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    return len(listed.group(1).split(",")) if listed else 1


def _ring_bytes(kind, phase, shape_text, n):
    """Bytes one chip sends of a collective over `n` chips done as a ring: (n - 1) / n of
    the whole tensor (twice for an all-reduce: a reduce-scatter and an all-gather)."""
    arrays = _arrays(shape_text)
    if not arrays or n < 2:
        return 0.0
    if kind == "all-gather":
        whole = max(arrays) if phase == "-start" else sum(arrays)  # (start: (shard, whole))
    elif kind == "reduce-scatter":
        whole = sum(arrays) * n  # (its result is the shard)
    else:
        whole = sum(arrays)
    return whole * (n - 1) / n * (2 if kind == "all-reduce" else 1)


def collective_records(text):
    """(kind, bytes each chip sends, overlaps compute) of each collective of the program.  The
    TPU scheduler overlaps a collective with compute by fusing the two into an
    `async_collective_fusion` computation (whose start and done halves are computations of
    their own, ending in AsyncCollectiveStart/Done custom calls, that name the collective
    again, as does each computation of a chain overlapping one collective: not counted twice),
    or by an async start ... done pair in the entry computation with compute scheduled between
    them; a collective elsewhere (a plain `all-reduce` in the entry computation, or in a fusion
    of its own) runs alone."""
    records = []
    chains = set()  # the chain_ids of the async collectives counted
    for computation, lines in _computations(text):
        if any(half in line for line in lines if "ROOT" in line for half in _ASYNC_HALVES):
            continue
        overlapping = computation.startswith("%async_collective_fusion")
        pending = {}  # an async start -> [its record's index, whether compute ran since]
        for line in lines:
            found = instruction(line)
            if found is None:
                continue
            name, shape, opcode = found
            kind = opcode.removesuffix("-start").removesuffix("-done")
            if kind not in _COLLECTIVES:
                if opcode in ("fusion", "convolution", "dot", "custom-call"):
                    for k in pending:
                        pending[k][1] = True
                continue
            phase = opcode[len(kind):]
            if phase == "-done":
                started = re.search(r"-done\((%[\w.-]+)", line)
                index, overlapped = pending.pop(started.group(1), (None, False)) if started else (None, False)
                if index is not None and overlapped:
                    records[index] = records[index][:2] + (True,)
                continue
            if overlapping:
                # One collective may overlap a chain of several computations, each naming it.
                chain = re.search(r'chain_id="(\d+)"', line)
                if chain is not None:
                    if chain.group(1) in chains:
                        continue
                    chains.add(chain.group(1))
            records.append((kind, _ring_bytes(kind, phase, shape, _group_size(line)), overlapping))
            if phase == "-start":
                pending[name] = [len(records) - 1, False]
    return records


def collectives(text):
    """{kind: (how many, how many overlap compute)} of the program's collectives
    (collective_records)."""
    found = collections.defaultdict(lambda: [0, 0])
    for kind, _, overlapped in collective_records(text):
        found[kind][0] += 1
        found[kind][1] += overlapped
    return {k: tuple(v) for k, v in found.items()}


def collective_bytes(text):
    """{kind: (bytes each chip sends, of which overlapped)} (collective_records)."""
    found = collections.defaultdict(lambda: [0.0, 0.0])
    for kind, sent, overlapped in collective_records(text):
        found[kind][0] += sent
        found[kind][1] += sent if overlapped else 0.0
    return {k: tuple(v) for k, v in found.items()}


# -- every program built meanwhile, compiled for the target too ---------------------------
# Process-wide, not per thread: the programs a step builds are built on other threads too (the
# compile pool's workers, the autograd engine's thread that flushes a backward).
_targeting = []          # the Targeting contexts entered, innermost last
_inside = threading.local()  # set while this thread compiles for a target (not targeted again)


class Targeting:
    """`with torch.tpu.compile_for("v5e:1x1") as reports:` - every program built while it is
    open (on any thread) is also compiled for the target, and its Report appended to `reports`
    (a list; `print(reports)` or `reports.table()`)."""

    def __init__(self, target):
        topology(target)  # an unknown target or a missing libtpu raises here, not at a build
        self.target = target
        self.reports = Reports()

    def __enter__(self):
        _targeting.append(self)
        return self.reports

    def __exit__(self, *exc):
        _targeting.remove(self)


class Reports(list):
    def table(self):
        return "\n".join(map(str, self))

    def total(self):
        """The sums a step of several programs has (flops, bytes, roofline, compile seconds),
        and its largest HBM."""
        return dict(programs=len(self), flops=sum(r.flops for r in self),
                    bytes_accessed=sum(r.bytes_accessed for r in self),
                    optimal_seconds=sum(r.optimal_seconds for r in self),
                    compile_seconds=sum(r.compile_seconds for r in self),
                    hbm_bytes=max((r.hbm_bytes for r in self), default=0),
                    errors=sum(bool(r.error) for r in self))


def active():
    if getattr(_inside, "on", False):
        return None
    return _targeting[-1] if _targeting else None


def retargeted(fn, options):
    """`jax.jit(fn, **options)` for a target: placements given as options name this process's
    devices, so the target's program takes them from its arguments.  `fn` is traced afresh
    (JAX keeps one trace per function and argument types, whatever the devices, and the
    lowerings that choose by platform must choose for the target)."""
    @functools.wraps(fn)
    def for_target(*args, **kwargs):
        return fn(*args, **kwargs)
    return jax.jit(for_target, **{k: v for k, v in options.items()
                                  if k not in ("in_shardings", "out_shardings", "device",
                                               "backend")})


def alongside(compile_for, args):
    """Called by every build of a program, with its `compile_for(target, *args)` and its
    arguments: inside a `Targeting`, compile it for the target too."""
    targeting = active()
    if targeting is None:
        return
    _inside.on = True  # a build inside the target's compile is not targeted again
    try:
        targeting.reports.append(compile_for(targeting.target, *args))
    finally:
        _inside.on = False
