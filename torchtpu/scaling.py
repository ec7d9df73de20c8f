"""A projection of FSDP and HSDP training to TPU slices: `python -m torchtpu.scaling`.

This is a model, not a measurement: no TPU ran it.  It takes

- the training step's own program: the model (a Llama-style config) is built on `meta`,
  materialised on tpu without memory (`to_empty`), and one step (forward, backward, AdamW) is
  recorded into a fused trace that reads nothing (its inputs are described, not allocated) and
  lowered and compiled by XLA for this machine; XLA's cost analysis gives its FLOPs.  Steps of
  1 and 2 layers give the per-layer and the per-model costs, so a 32-layer model costs two
  small compiles.  The HBM traffic is the least a step must move (weights read in the forward
  and the backward, gradients, AdamW's state): XLA:CPU's count of bytes accessed is printed
  beside it but not used, since it does not fuse as a TPU does (it is several times larger);
- the collectives FSDP issues per step: each FSDP unit's parameters all-gathered in the forward
  and again in the backward (reshard_after_forward), and its gradients reduce-scattered, as
  torchtpu's FSDP2 programs do (benchmarks/scaling.py checks the bytes they move against this);
  with HSDP the reduce-scattered gradient shards are also all-reduced across slices over DCN;
- published chip figures (CHIPS, each with its source).

and estimates per chip: compute time (the roofline of FLOPs and HBM bytes), the time of each
collective per mesh axis (ICI rings along the torus axes the FSDP axis spans; DCN across
slices), how much of it the schedule can hide (XLA's latency-hiding scheduler overlaps a
layer's collectives with another layer's compute: all of it but the first all-gather and the
last reduce-scatter while communication is shorter than compute, none of the excess beyond),
and so the step time, the utilisation (model FLOPs / peak / step time) and the scaling
efficiency (compute time / step time).

Checked against Austin et al., "How to Scale Your Model" (2025), part 5 (training): FSDP is
compute-bound above C / W_ici tokens per chip (2,550 on one v5p ICI axis, 850 on three);
`critical_tokens_per_chip` gives that threshold from this model (tests/test_scaling.py).
"""
import argparse
import dataclasses
import sys


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


# --- the program's cost -------------------------------------------------------------------------
def _model(config, layers, dtype):
    import torch
    from torchtpu.examples.models import Llama
    with torch.device("meta"):
        m = Llama(vocab=config["vocab"], d=config["d"], layers=layers, heads=config["heads"],
                  hidden=config["hidden"], kv_heads=config["kv_heads"])
    return m.to(dtype).to_empty(device="tpu")


def step_cost(config, layers, seq, batch, dtype="bfloat16"):
    """(FLOPs, bytes accessed) of one training step of `batch` sequences of `seq` tokens on one
    chip, from XLA's cost analysis of the step's program (nothing is run or allocated)."""
    import torch
    from ._execution import fused
    dtype = getattr(torch, dtype)
    model = _model(config, layers, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
    for p in model.parameters():  # the state a first step would make, described only
        opt.state[p] = {"step": torch.zeros((), device="tpu"), "exp_avg": torch.empty_like(p),
                        "exp_avg_sq": torch.empty_like(p)}
    tokens = torch.empty(batch, seq + 1, dtype=torch.long, device="tpu")
    tr, previous = fused.start_capture(torch.tpu.current_device(), by_storage=True, abstract=True)
    try:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
    finally:
        intact = fused.stop_capture(tr, previous)
    if not intact:
        raise RuntimeError("the step could not be recorded as one program")
    types = tuple(map(type, tr.scalars))
    segment = fused.Segment(tuple(tr.signature), [p.slot for p in tr.live_outputs()], types,
                            "projection")
    try:
        compiled = segment.lower(list(tr.ext_arrays), fused.pack_scalars(tr.scalars, types)).compile()
    finally:
        tr.release()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]), float(cost["bytes accessed"])


@dataclasses.dataclass
class Program:
    """Per-chip costs of one step for `batch` sequences."""
    flops: float
    bytes: float       # the least HBM traffic (see the module docstring)
    params: int        # parameters of the whole model
    layer_params: int  # of one layer (an FSDP unit)
    cpu_bytes: float = None  # XLA:CPU's bytes accessed, for reference


def _sizes(config):
    d = config["d"]
    kv_dim = d // config["heads"] * config["kv_heads"]
    layer_params = d * (d + 2 * kv_dim) + d * d + 3 * d * config["hidden"] + 2 * d
    return config["layers"] * layer_params + 2 * config["vocab"] * d + d, layer_params


def _least_bytes(params):
    # bf16 weights read in the forward and the backward; fp32 master weights, gradients and
    # AdamW's two moments read, and weights and moments written, by the optimizer.
    return params * 2 * 2 + params * 4 * 7


def program_cost(config, seq, batch, dtype="bfloat16"):
    """The program's FLOPs (XLA's cost analysis of 1- and 2-layer steps, extrapolated)."""
    f1, b1 = step_cost(config, 1, seq, batch, dtype)
    f2, b2 = step_cost(config, 2, seq, batch, dtype)
    layers = config["layers"]
    params, layer_params = _sizes(config)
    return Program(flops=f1 + (layers - 1) * (f2 - f1), bytes=_least_bytes(params),
                   params=params, layer_params=layer_params,
                   cpu_bytes=b1 + (layers - 1) * (b2 - b1))


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
def _slices(spec):
    """'v5e-256' -> ('v5e', 256)."""
    name, _, n = spec.partition("-")
    return name, int(n)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m torchtpu.scaling",
                                 description="Projected FSDP/HSDP step time, utilisation and "
                                             "scaling efficiency on TPU slices (a model).")
    ap.add_argument("--model", default="llama-1b", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per chip")
    ap.add_argument("--slice", action="append", dest="slices_",
                    help="e.g. v5e-64, v5e-256, v5p-1024 (repeatable)")
    ap.add_argument("--hsdp", type=int, default=1, help="slices of that size, over DCN")
    ap.add_argument("--dcn-gbps", type=float, help="DCN bandwidth per chip (Gbps)")
    ap.add_argument("--analytic", action="store_true",
                    help="formulas instead of the compiled program's cost analysis")
    a = ap.parse_args(argv)
    config = MODELS[a.model]
    if a.analytic:
        program = analytic_cost(config, a.seq, a.batch)
        how = "analytic formulas"
    else:
        import torchtpu  # noqa: F401  (the device, to record the step)
        program = program_cost(config, a.seq, a.batch)
        how = "XLA's cost analysis of the step's program (1 and 2 layers, extrapolated)"
    cpu = "" if program.cpu_bytes is None else \
        f" (XLA:CPU's bytes accessed, unfused: {program.cpu_bytes / 1e9:.1f} GB)"
    print(f"# a projection (a model, not a measurement): {a.model}, {a.batch} x {a.seq} tokens "
          f"per chip; FLOPs from {how}: {program.flops / 1e12:.2f} TFLOP per step per chip; "
          f"least HBM traffic {program.bytes / 1e9:.2f} GB{cpu}; "
          f"{program.params / 1e9:.2f}B parameters")
    dcn = None if a.dcn_gbps is None else a.dcn_gbps * 1e9 / 8
    for spec in a.slices_ or ["v5e-64", "v5e-256", "v5p-1024"]:
        name, n = _slices(spec)
        chip = CHIPS[name]
        for kind, slices in (("FSDP", 1), ("HSDP", a.hsdp)) if a.hsdp > 1 else (("FSDP", 1),):
            p = project(program, chip, n, slices, layers=config["layers"], dcn=dcn)
            total = n * slices
            print(f"{spec:10s} {kind} x{slices} ({total} chips): compute {p.compute * 1e3:8.2f} ms, "
                  f"ICI {p.ici * 1e3:7.2f} ms, DCN {p.dcn * 1e3:7.2f} ms, exposed "
                  f"{p.exposed * 1e3:6.2f} ms -> step {p.step * 1e3:8.2f} ms, utilisation "
                  f"{p.utilisation:.0%}, scaling efficiency {p.efficiency:.0%}")
        crit = critical_tokens_per_chip(chip, chip.axes)
        print(f"{'':10s} FSDP is compute-bound above {crit:,.0f} tokens per chip on all "
              f"{chip.axes} ICI axes ({critical_tokens_per_chip(chip, 1):,.0f} on one); "
              f"{chip.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
