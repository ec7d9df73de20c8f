"""FSDP and HSDP training on TPU slices, before renting one: `python -m torchtpu.scaling`.

Two views, printed side by side.

The compiled step (needs libtpu, not a TPU).  The real training step, PyTorch's FSDP2 set up as
torchtitan does (`fully_shard` per block and the root, bf16 parameters all-gathered, gradients
reduced in float32, AdamW), of a Llama-style model built on `meta`: the process is rank 0 of a
world of as many ranks as the slice has chips (`process_group.projected_world`, whose mesh is
the slice's compile-only chips), the step is recorded once without running or reading anything,
and that program, the one every chip runs, collectives included, is compiled by libtpu for the
slice.  Read from the compiler: HBM per chip (and whether it fits: where it does not, the
step again with each block's activations checkpointed; the largest batch that fits, HBM being
linear in the batch between two compiles), the roofline (`optimal_seconds`; Pallas kernels,
i.e. attention, are not costed, so its FLOPs are added at the chip's peak), and the schedule's
collectives: the bytes each chip sends, timed at its ICI bandwidth, exposed where the schedule
runs them alone, and where overlapped, exposed only beyond the compute there is to hide them.
Steps of 1 and 3 layers are compiled and the rest extrapolated (each layer costs half what the
second and third added), so a 32-layer model costs two compiles of small programs.  (Two
samples, not 1 and 2 layers: HBM per layer is not the same from one layer to the next, the
compiler placing buffers anew; an 8B Llama's on v5e:16x16 rose 3.0 then 0.8 GiB, JAX's step's
1.6 then 2.8.)

The analytic model (`--analytic` alone, or where libtpu is missing): the FLOPs of the usual
formulas, the least HBM traffic a step must move, the collectives FSDP issues per step (each
unit's parameters all-gathered in the forward and again in the backward, gradients
reduce-scattered; with HSDP the shards also all-reduced across slices over DCN) along the
torus axes the FSDP axis spans, hidden but for the first all-gather and the last
reduce-scatter while communication is shorter than compute; published chip figures (CHIPS,
each with its source).  A model, not a measurement.  Checked against Austin et al., "How to
Scale Your Model" (2025), part 5 (training): FSDP is compute-bound above C / W_ici tokens per
chip (2,550 on one v5p ICI axis, 850 on three); `critical_tokens_per_chip` gives that threshold
from this model (tests/test_scaling.py).

Neither view ran on a TPU: the compiled one is what libtpu builds and its cost model says.
"""
import argparse
import dataclasses
import json
import math
import re
import sys
import time


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak: float        # bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm: float         # bytes
    ici: float         # bidirectional ICI bytes/s per chip, all ports
    ports: int         # ICI ports per chip (2 per torus axis)
    dcn: float         # bytes/s per chip across slices (None: not published)
    source: str

    @property
    def axes(self):
        return self.ports // 2

    @property
    def axis_bandwidth(self):
        """Bytes/s a chip receives in a ring collective along one torus axis: its two ports
        on that axis, each one way."""
        return self.ici / self.ports


CHIPS = {
    "v5e": Chip("TPU v5e", 197e12, 819e9, 16e9, 400e9, 4, 2 * 100e9 / 8 / 8,
                "https://cloud.google.com/tpu/docs/v5e (197 TFLOPs bf16, 819 GBps HBM, 400 GBps "
                "ICI over 4 ports, 2 x 100 Gbps NIC per 8-chip host)"),
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 95e9, 1200e9, 6, 50e9 / 8,
                "https://cloud.google.com/tpu/docs/v5p (459 TFLOPs bf16, 2765 GBps HBM, 1200 GBps "
                "ICI, 3D torus, 50 Gbps DCN per chip)"),
    "v6e": Chip("TPU v6e", 918e12, 1638e9, 32e9, 800e9, 4, None,
                "https://cloud.google.com/tpu/docs/v6e (918 TFLOPs bf16, 1638 GBps HBM, 800 GBps "
                "ICI over 4 ports; DCN not published: pass --dcn-gbps)"),
}

# Llama-style configurations (the public Llama 3.2 1B and Llama 3 8B shapes).
MODELS = {
    "llama-1b": dict(vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, hidden=8192),
    "llama-8b": dict(vocab=128256, d=4096, layers=32, heads=32, kv_heads=8, hidden=14336),
    "tiny": dict(vocab=256, d=64, layers=2, heads=4, kv_heads=2, hidden=128),
}


# --- the analytic model's costs -------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
    """Per-chip costs of one step for `batch` sequences."""
    flops: float
    bytes: float       # the least HBM traffic (see the module docstring)
    params: int        # parameters of the whole model
    layer_params: int  # of one layer (an FSDP unit)


def _sizes(config):
    d = config["d"]
    kv_dim = d // config["heads"] * config["kv_heads"]
    layer_params = d * (d + 2 * kv_dim) + d * d + 3 * d * config["hidden"] + 2 * d
    return config["layers"] * layer_params + 2 * config["vocab"] * d + d, layer_params


def _least_bytes(params):
    # bf16 weights read in the forward and the backward; fp32 master weights, gradients and
    # AdamW's two moments read, and weights and moments written, by the optimizer.
    return params * 2 * 2 + params * 4 * 7


def analytic_cost(config, seq, batch):
    """The same from the usual formulas (6 FLOPs per parameter and token, plus attention's
    2 x 2 x seq x d per token and layer, three times for forward and backward), for
    comparison and for sizes too large to compile here."""
    layers, d = config["layers"], config["d"]
    params, layer_params = _sizes(config)
    tokens = seq * batch
    flops = 6 * params * tokens + layers * 3 * 4 * seq * d * tokens
    return Program(flops=flops, bytes=_least_bytes(params), params=params,
                   layer_params=layer_params)


# --- the real FSDP2 step compiled for a slice ---------------------------------------------------
_TENSORCORE_NAMED = ("v4", "v5p")  # slices named by TensorCores, two per chip


def _chips(spec):
    """(generation, chips) of a slice's name ('v5e-256' -> ('v5e', 256); 'v5p-1024' -> ('v5p',
    512)) or of a topology ('v5e:16x16' -> ('v5e', 256))."""
    if ":" in spec:
        name, _, bounds = spec.partition(":")
        return name, math.prod(int(b) for b in bounds.split("x"))
    name, _, n = spec.partition("-")
    return name, int(n) // 2 if name in _TENSORCORE_NAMED else int(n)


def topology_of(spec):
    """A TPU target for libtpu: 'v5e:16x16' as given, or a slice's name ('v5e-256', 'v6e-64';
    v5p's count TensorCores, two per chip: 'v5p-1024' is 512 chips) as the squarest torus of
    its chips (2-D for v5e and v6e, 3-D for v4 and v5p)."""
    if ":" in spec:
        return spec
    name, chips = _chips(spec)
    dims = [1, 1, 1] if name in _TENSORCORE_NAMED else [1, 1]
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"{spec}: a slice of a power-of-two number of chips (got {chips})")
    while chips > 1:
        dims[dims.index(min(dims))] *= 2
        chips //= 2
    return f"{name}:{'x'.join(map(str, sorted(dims)))}"


def _fsdp_model(config, layers, checkpoint):
    """The Llama of `config` with `layers` layers on tpu, set up as torchtitan does (fully_shard
    units below; bf16 parameters all-gathered, gradients reduced in float32), its
    storages allocated lazily (to_empty: nothing is read before the step is recorded)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtpu.examples.models import Llama
    with torch.device("meta"):
        model = Llama(vocab=config["vocab"], d=config["d"], layers=layers, heads=config["heads"],
                      hidden=config["hidden"], kv_heads=config["kv_heads"])
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # torchtitan's units: the embedding, each block, the final norm with the output
    # projection, the root (left with nothing: a unit of the embedding and the output, 2 x
    # 525M parameters for a 128k vocabulary, would hold both unsharded, with their float32
    # gradients, at once).
    # The last block and the output unit stay unsharded after the forward (the backward
    # starts with them), as torchtitan leaves them.
    fully_shard(model.embed, mp_policy=policy)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < layers - 1)
    fully_shard([model.norm, model.head], mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy)
    return model.to_empty(device="tpu")


def _recorded_step(model, seq, batch):
    """(segment, its Recording): one training step (forward, backward, AdamW) recorded as one
    program without running or reading anything (its inputs are described), its Python
    numbers baked in as a torch.tpu graph of the step bakes them (segment.baked_numbers: packed,
    they were float64 and int64 arrays, emulated on TPU, and the views' offsets made dynamic
    slices: 1,100 scalar instructions and 13 more seconds of compile for one Llama-1B layer on
    v5e:2x2)."""
    import torch
    from ._execution import recording
    from ._execution.segment import Segment
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True, foreach=True)
    for p in model.parameters():  # the state a first step would make, described only
        opt.state[p] = {"step": torch.zeros((), device="tpu"), "exp_avg": torch.empty_like(p),
                        "exp_avg_sq": torch.empty_like(p)}
    tokens = torch.empty(batch, seq + 1, dtype=torch.long, device="tpu")
    capture = recording.start_capture(torch.tpu.current_device(), by_storage=True, abstract=True)
    try:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
    finally:
        recorded = recording.stop_capture(*capture)
    if not recorded.intact:
        recorded.release()
        raise RuntimeError("the step could not be recorded as one program")
    return Segment.from_recording(recorded, "FSDP2 step", baked=True), recorded


def fsdp_step_report(config, target, layers, seq, batch, checkpoint=False):
    """tpu_compiler.Report of one rank's FSDP2 training step of the `layers`-layer model of
    `config`, `batch` sequences of `seq` tokens per chip, compiled for `target` (every chip a
    rank: the program each of them runs, collectives included)."""
    from ._core import tpu_compiler
    from ._distributed.process_group import projected_world
    from ._execution.segment import pack_scalars
    chips = tpu_compiler.topology(target)
    with projected_world(chips):
        model = _fsdp_model(config, layers, checkpoint)
        segment, recorded = _recorded_step(model, seq, batch)
        try:
            arrays = list(recorded.inputs)
            return segment.compile_for(target, arrays, pack_scalars(recorded.scalars,
                                                                    recorded.scalar_types),
                                       # (donated as a run donates them: compiled
                                       # with none, a step holds its parameters and
                                       # optimizer state twice)
                                       recorded.overwritten())
        finally:
            recorded.release()


@dataclasses.dataclass
class Compiled:
    """What the TPU compiler says of the whole model's step per chip: from the steps of
    SAMPLED layers (each layer costing the same), or of every layer (`whole`)."""
    target: str
    chips: int
    batch: int
    hbm: float          # bytes per chip
    capacity: float
    roofline: float     # s (the compiler's; Pallas kernels, i.e. attention, not in it)
    attention: float    # s: attention's FLOPs at the chip's peak (its Pallas kernel, uncosted)
    flops: float        # per chip, attention's excluded
    bytes: float
    sent: float         # bytes each chip sends in collectives
    sent_overlapped: float  # of which the schedule overlaps with compute
    compile_seconds: float  # of the steps compiled
    reports: list = dataclasses.field(default_factory=list, repr=False)
    whole: bool = False  # every layer compiled (so the compiler, which refuses what does not
                         # fit its HBM, accepted it: its own count of HBM is not memory_analysis')

    @property
    def fits(self):
        return self.whole or self.hbm <= self.capacity


SAMPLED = (1, 3)  # the layers of the steps compiled


def _extrapolated(first, last, layers):
    a, b = SAMPLED
    return first + (layers - a) * (last - first) / (b - a)


def compiled_cost(config, target, seq, batch, checkpoint=False, report=fsdp_step_report,
                  full=False):
    """Compiled: the steps of SAMPLED layers compiled for `target` (`report(config, target,
    layers, seq, batch, checkpoint)`), extrapolated to the model's layers; with `full`, the
    step of every layer, compiled once."""
    from ._core import tpu_compiler
    layers = config["layers"]
    if full:
        reports = [report(config, target, layers, seq, batch, checkpoint)]
        r1 = r2 = reports[0]
    else:
        reports = [report(config, target, n, seq, batch, checkpoint) for n in SAMPLED]
        r1, r2 = reports
    for r in reports:
        if r.error:
            short = re.search(r"temporaries \(([\d.]+)G\) exceeds", r.error)
            if short:
                raise DoesNotFit(float(short.group(1)) * 2**30, r.error)
            raise RuntimeError(f"the step does not compile for {target}: {r.error}")
    chip = CHIPS[r1.chip]

    def x(get):
        return get(r1) if full else _extrapolated(get(r1), get(r2), layers)

    sent = {k: x(lambda r: sum(v[i] for v in r.collective_bytes.values())) for k, i in
            (("sent", 0), ("overlapped", 1))}
    attention = layers * 3 * 2 * seq * config["d"] * seq * batch / chip.peak  # causal: half of 4
    return Compiled(target=target, chips=len(tpu_compiler.topology(target)), batch=batch,
                    hbm=x(lambda r: r.hbm_bytes), capacity=r1.hbm_capacity,
                    roofline=x(lambda r: r.optimal_seconds), attention=attention,
                    flops=x(lambda r: r.flops), bytes=x(lambda r: r.bytes_accessed),
                    sent=sent["sent"], sent_overlapped=sent["overlapped"],
                    compile_seconds=sum(r.compile_seconds for r in reports), reports=reports,
                    whole=full)


@dataclasses.dataclass
class Scheduled:
    """A step time from the compiled program: its roofline (plus attention), and the time of
    its collectives at the chip's ICI bandwidth: those the schedule runs alone exposed, and
    the overlapped ones exposed beyond the compute there is to hide them under."""
    compute: float
    collectives: float
    exposed: float
    step: float
    utilisation: float  # model FLOPs (6 per parameter and token, plus attention) / peak / step


def scheduled(compiled, chip, model_flops, axes=None):
    bandwidth = (axes or chip.axes) * chip.axis_bandwidth
    compute = compiled.roofline + compiled.attention
    alone = (compiled.sent - compiled.sent_overlapped) / bandwidth
    hidden = compiled.sent_overlapped / bandwidth
    exposed = alone + max(0.0, hidden - compute)
    step = compute + exposed
    return Scheduled(compute=compute, collectives=alone + hidden, exposed=exposed, step=step,
                     utilisation=model_flops / chip.peak / step)


class DoesNotFit(RuntimeError):
    """The compiler refused the step: its temporaries alone (`temporaries` bytes, of one of
    the steps compiled) exceed the chip's HBM."""

    def __init__(self, temporaries, error):
        super().__init__(error)
        self.temporaries = temporaries


def largest_batch(config, target, seq, fitted, checkpoint=False, report=fsdp_step_report,
                  full=False):
    """(the largest batch per chip that fits, Compiled at twice `fitted`'s batch): HBM taken as
    linear in the batch between the two compiles."""
    doubled = compiled_cost(config, target, seq, 2 * fitted.batch, checkpoint, report, full)
    per_sequence = (doubled.hbm - fitted.hbm) / fitted.batch
    if per_sequence <= 0:
        return None, doubled
    return int(fitted.batch + (fitted.capacity - fitted.hbm) // per_sequence), doubled


def compiled_summary(config, target, seq, batch, fit=True, report=fsdp_step_report, full=False):
    """The figures `python -m torchtpu.scaling` prints for one slice from the compiled step
    (a dict; `summary_line`): HBM per chip and whether it fits (where it does not, whether it
    does with each block's activations checkpointed; with `fit`, the largest batch that fits),
    the roofline, the collectives' time and what of it the schedule leaves exposed, the step
    time and utilisation."""
    from ._core import tpu_compiler
    devices = tpu_compiler.topology(target)
    name, capacity = tpu_compiler.CHIPS[devices[0].device_kind]  # (the Reports' capacity)
    chip = CHIPS[name]
    row = dict(target=target, chips=len(devices), batch=batch, seq=seq, checkpointed=False,
               capacity=capacity, layers_compiled=[config["layers"]] if full else list(SAMPLED))
    compiled = None
    for checkpoint in (False, True):  # each block's activations kept, else recomputed
        try:
            attempt = compiled_cost(config, target, seq, batch, checkpoint, report, full)
        except DoesNotFit as e:
            if compiled is None:
                row.update(fits=False, checkpointed=checkpoint, hbm_at_least=e.temporaries)
            continue
        compiled = attempt
        row.update(checkpointed=checkpoint)
        if compiled.fits:
            break
    if compiled is None:
        return row
    model_flops = analytic_cost(config, seq, batch).flops
    s = scheduled(compiled, chip, model_flops)
    row.update(fits=compiled.fits, hbm=compiled.hbm, roofline=compiled.roofline, attention=compiled.attention, flops=compiled.flops,
               bytes=compiled.bytes, sent=compiled.sent, sent_overlapped=compiled.sent_overlapped,
               collectives=s.collectives, exposed=s.exposed, step=s.step,
               utilisation=s.utilisation, compile_seconds=compiled.compile_seconds)
    if fit and compiled.fits:
        try:
            largest, doubled = largest_batch(config, target, seq, compiled, row["checkpointed"],
                                             report, full)
            row["compile_seconds"] += doubled.compile_seconds
        except DoesNotFit:
            largest = batch
        row["largest_batch"] = largest
    return row


def summary_line(row):
    if "step" not in row:
        return (f"{row['target']}: does not fit at {row['batch']} x {row['seq']} tokens per "
                f"chip{' even with activation checkpointing' if row['checkpointed'] else ''}: "
                f"temporaries alone {row['hbm_at_least'] / 2**30:.1f} GiB > "
                f"{row['capacity'] / 2**30:.0f} GiB")
    largest = row.get("largest_batch")
    return (f"{row['target']}: HBM {row['hbm'] / 2**30:.2f} of {row['capacity'] / 2**30:.0f} GiB "
            f"per chip ({'fits' if row['fits'] else 'DOES NOT FIT'}"
            f"{', activations checkpointed' if row['checkpointed'] else ''}"
            f"{f'; largest batch {largest}' if largest is not None else ''}); roofline "
            f"{row['roofline'] * 1e3:.1f} ms + attention {row['attention'] * 1e3:.1f} ms; "
            f"{row['bytes'] / 1e9:.1f} GB accessed; collectives {row['sent'] / 1e9:.2f} GB sent "
            f"({row['sent_overlapped'] / max(row['sent'], 1):.0%} overlapped), "
            f"{row['collectives'] * 1e3:.1f} ms, exposed {row['exposed'] * 1e3:.1f} ms -> step "
            f"{row['step'] * 1e3:.1f} ms, utilisation {row['utilisation']:.0%}; compiled in "
            f"{row['compile_seconds']:.0f} s")


# --- the projection ----------------------------------------------------------------------------
@dataclasses.dataclass
class Projection:
    compute: float      # s per step per chip
    ici: float          # s of FSDP collectives per step per chip
    dcn: float          # s of the cross-slice all-reduce per step per chip
    exposed: float      # s of communication not hidden under compute
    step: float
    utilisation: float  # model FLOPs / peak / step
    efficiency: float   # compute / step


def project(program, chip, chips, slices=1, comm_bytes=2, grad_bytes=4, axes=None,
            layers=None, dcn=None):
    """Step time of FSDP over `chips` chips of a slice (HSDP across `slices` slices) for a
    program of these per-chip costs; `comm_bytes` per parameter all-gathered (bf16 weights),
    `grad_bytes` per gradient reduce-scattered (fp32 reduction); `axes`: torus axes the FSDP
    axis spans (default: all of the chip's)."""
    axes = axes or chip.axes
    layers = layers or max(1, round(program.params / max(program.layer_params, 1)))
    compute = max(program.flops / chip.peak, program.bytes / chip.hbm_bandwidth)
    share = (chips - 1) / chips
    gathered = 2 * program.params * comm_bytes * share  # forward and backward
    scattered = program.params * grad_bytes * share
    ici = (gathered + scattered) / (axes * chip.axis_bandwidth)
    dcn_time = 0.0
    if slices > 1:
        bandwidth = dcn if dcn is not None else chip.dcn
        if bandwidth is None:
            raise ValueError(f"{chip.name}: no published DCN bandwidth; pass one (--dcn-gbps)")
        shard = program.params * grad_bytes / chips
        dcn_time = 2 * shard * (slices - 1) / slices / bandwidth
    comm = ici + dcn_time
    # Hidden: all but the first layer's all-gather and the last's reduce-scatter, up to the
    # compute there is to hide them under.
    per_layer = comm / layers
    exposed = per_layer + max(0.0, comm - per_layer - compute)
    step = compute + exposed
    return Projection(compute=compute, ici=ici, dcn=dcn_time, exposed=exposed, step=step,
                      utilisation=program.flops / chip.peak / step, efficiency=compute / step)


def critical_tokens_per_chip(chip, axes=1, comm_bytes=2, grad_bytes=2):
    """Tokens per chip above which FSDP's communication (two all-gathers and a reduce-scatter
    of every parameter per step) takes less time than its compute (6 FLOPs per parameter and
    token): C / (W / ((2 * comm_bytes + grad_bytes) / 6)); with bf16 everywhere, C / W."""
    per_param_bytes = 2 * comm_bytes + grad_bytes
    return chip.peak * per_param_bytes / (6 * axes * chip.axis_bandwidth)


# --- the command --------------------------------------------------------------------------------
def _analytic_lines(program, config, spec, hsdp, dcn):
    name, n = _chips(spec)
    chip = CHIPS[name]
    lines = []
    for kind, slices in (("FSDP", 1), ("HSDP", hsdp)) if hsdp > 1 else (("FSDP", 1),):
        p = project(program, chip, n, slices, layers=config["layers"], dcn=dcn)
        lines.append(f"{spec:10s} {kind} x{slices} ({n * slices} chips): compute "
                     f"{p.compute * 1e3:8.2f} ms, ICI {p.ici * 1e3:7.2f} ms, DCN "
                     f"{p.dcn * 1e3:7.2f} ms, exposed {p.exposed * 1e3:6.2f} ms -> step "
                     f"{p.step * 1e3:8.2f} ms, utilisation {p.utilisation:.0%}, scaling "
                     f"efficiency {p.efficiency:.0%}")
    crit = critical_tokens_per_chip(chip, chip.axes)
    lines.append(f"{'':10s} FSDP is compute-bound above {crit:,.0f} tokens per chip on all "
                 f"{chip.axes} ICI axes ({critical_tokens_per_chip(chip, 1):,.0f} on one); "
                 f"{chip.source}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m torchtpu.scaling",
        description="FSDP/HSDP training on TPU slices: the real FSDP2 step compiled for the "
                    "slice by libtpu (no TPU needed), beside an analytic model.")
    ap.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per chip")
    ap.add_argument("--slice", action="append", dest="slices_",
                    help="e.g. v5e-64, v5e-256, v5p-1024, or a topology such as v5e:16x16 "
                         "(repeatable)")
    ap.add_argument("--hsdp", type=int, default=1, help="slices of that size, over DCN "
                    "(the analytic model's)")
    ap.add_argument("--dcn-gbps", type=float, help="DCN bandwidth per chip (Gbps)")
    ap.add_argument("--analytic", action="store_true",
                    help="the analytic model only: formulas, nothing compiled")
    ap.add_argument("--no-fit", action="store_true",
                    help="skip the search for the largest batch that fits (two compiles)")
    ap.add_argument("--full", action="store_true",
                    help="compile every layer (minutes per slice) instead of 1 and 3: the "
                         "compiler schedules within the chip's HBM, so only this settles "
                         "whether a step that is near it fits")
    ap.add_argument("--json", help="write the compiled figures here")
    a = ap.parse_args(argv)
    config = MODELS[a.model]
    slices = a.slices_ or ["v5e-64", "v5e-256", "v5p-1024"]
    dcn = None if a.dcn_gbps is None else a.dcn_gbps * 1e9 / 8
    compiled = not a.analytic
    if compiled:
        import torchtpu  # noqa: F401  (the device, to record the step)
        from ._core import tpu_compiler
        if not tpu_compiler.have_libtpu():
            print("# libtpu is not installed (pip install 'torchtpu[tpu]'): nothing is compiled "
                  "for the slices; the analytic model only", flush=True)
            compiled = False
    program = analytic_cost(config, a.seq, a.batch)
    print(f"# {a.model} ({program.params / 1e9:.2f}B parameters), FSDP over every chip, "
          f"{a.batch} x {a.seq} tokens per chip, {time.strftime('%Y-%m-%d')}", flush=True)
    rows = []
    for spec in slices:
        if compiled:
            target = topology_of(spec)
            row = compiled_summary(config, target, a.seq, a.batch, fit=not a.no_fit, full=a.full)
            rows.append(row)
            print(f"{spec:10s} compiled for {summary_line(row)}", flush=True)
        for line in _analytic_lines(program, config, spec, a.hsdp, dcn):
            print(f"{line}{'  (analytic model)' if compiled and 'chips)' in line else ''}",
                  flush=True)
    if compiled:
        sampled = "every layer" if a.full else \
            f"steps of {SAMPLED[0]} and {SAMPLED[1]} layers, extrapolated"
        print(f"# compiled: libtpu's program for one chip of the slice ({sampled}); its "
              "roofline leaves out Pallas kernels (attention, added at the chip's peak); "
              "collectives at the chip's ICI bandwidth, those the schedule runs alone exposed")
    print("# analytic: a model, not a measurement (torchtpu/scaling.py)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, seq=a.seq, batch=a.batch, slices=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
