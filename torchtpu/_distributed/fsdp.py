"""FSDP2 (`fully_shard`) on a TPU mesh: each parameter all-gathered into its own unsharded
storage and each gradient reduce-scattered on its own, as JAX's FSDP does, instead of one
collective over the unit's concatenated shards or gradients.

FSDP2 gathers a unit as one flat buffer: the shards are copied into it (copy-in), gathered, and
copied out of its (ranks, total) view column by column into each parameter's storage
(copy-out).  On a GPU those copies are cheap kernels.  XLA:TPU lays a flat array out in tiles of
1,024 elements and a (ranks, n) array in tiles of 8 x 128, so the copy-out becomes relayout
loops over the whole unit, and a unit's gathered buffer is a temporary beside its parameters.
Measured with libtpu 0.0.42.1 on v5e:2x2 for the parameters of one Llama-1B block: 28-37 s of
compile and 232 MiB of temporaries, against 2.6-4.6 s and 0.8 MiB (4 of its 9 all-gathers
overlapped) gathered per parameter (benchmarks/tpu_fsdp_gather.py).  So on a group whose mesh
is TPU chips (a real slice, or one `projected_world` compiles for), every parameter's all-gather
input is gathered straight into that parameter's all-gather output: no copy-in, no copy-out,
one collective per parameter; XLA:TPU combines or overlaps them as its scheduler sees fit.
The gradients likewise (`_reduce`: FSDP2's `_chunk_cat` of a unit's gradients into its
(ranks, total) buffer is the same relayout; per parameter, 3.4x fewer bytes and 3.6x less HBM
for that block).  Values are the same; elsewhere (the CPU, a GPU) FSDP2's own path runs, one
collective per unit.

Parameters FSDP2 shards on a dimension other than 0, and units with a custom all-gather
(`set_custom_all_gather`), keep FSDP2's all-gather; `_reduce` says which reductions keep
FSDP2's."""
import inspect
import os

import torch

import torchtpu_autoload

from .._core import metrics

_originals = {}
_reduce_signature = None  # FSDP2's foreach_reduce's, read once
_group = None  # a c10d group -> its ProcessGroupTPU (process_group.group_named, given to install)
_GROUP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def install(group_named):
    """Route FSDP2's unit all-gather and its copy-out through `_all_gather` / `_copy_out`
    and its reduce-scatter through `_reduce` (patches.PATCHES: applied when the first tpu
    process group is made, or, if FSDP2 is not imported yet, when it is: importing it here
    would import and register more of torch.distributed than the job asked for)."""
    global _group
    _group = group_named
    torchtpu_autoload.patch_on_import(_GROUP_MODULE, _patch)


def _patch(group_module):
    global _reduce_signature
    if _originals:
        return
    for name, new in (("foreach_all_gather", _all_gather),
                      ("foreach_all_gather_copy_out", _copy_out),
                      ("foreach_reduce", _reduce)):
        _originals[name] = getattr(group_module, name)
        new._torchtpu_patch = True
        setattr(group_module, name, new)
    _reduce_signature = inspect.signature(_originals["foreach_reduce"])


def _gather_per_parameter(fsdp_params, group, all_gather_comm):
    """Whether this unit's all-gather is made one collective per parameter."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    if type(all_gather_comm) is not DefaultAllGather:
        return False
    if any(p.fsdp_placement.dim != 0 for p in fsdp_params):
        return False
    return _per_parameter_over(group)


def _per_parameter_over(group):
    """Whether FSDP2's collectives over `group` go per parameter: a tpu group over TPU chips,
    unless TORCHTPU_FSDP_PER_PARAMETER says otherwise ("1": every tpu group, as benchmarks
    compiling a CPU job's programs for a TPU target want; "0": none)."""
    if group is None:
        return False
    try:
        mesh = _group(group).mesh
    except RuntimeError:  # not a tpu group
        return False
    setting = os.environ.get("TORCHTPU_FSDP_PER_PARAMETER", "auto")
    if setting in ("0", "1"):
        return setting == "1"
    return mesh is not None and next(iter(mesh.devices.flat)).platform == "tpu"


def _comm(args, kwargs):
    return kwargs.get("all_gather_comm", args[-1] if args else None)


def _all_gather(fsdp_params, group, async_op, *args, **kwargs):
    """FSDP2's `foreach_all_gather` (same arguments), per parameter on a TPU mesh."""
    comm = _comm(args, kwargs)
    if not _gather_per_parameter(fsdp_params, group, comm):
        return _originals["foreach_all_gather"](fsdp_params, group, async_op, *args, **kwargs)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult
    metrics.counters["fsdp_gathers_per_parameter"] += 1
    world = group.size()
    dtypes, numels, works = [], [], []
    with torch.no_grad():
        for p in fsdp_params:
            inputs = p.all_gather_inputs
            dtypes.append([t.dtype for t in inputs])
            numels.append([t.numel() for t in inputs])
            p.init_all_gather_outputs(numels[-1], dtypes[-1], world, p.device)
            p.alloc_all_gather_outputs()
            for output, input in zip(p.all_gather_outputs, inputs):
                works.append(comm(output_tensor=output, input_tensor=input, group=group,
                                  async_op=async_op))
    # No unit buffer (`all_gather_output` None marks the result as gathered per parameter):
    # the outputs are the parameters' own storages.  The works (async_op) are waited in
    # `_copy_out`, as FSDP2 waits its one.
    return AllGatherResult(None, None, tuple(works) if async_op else None, dtypes, numels,
                           [n for ns in numels for n in ns])


def _copy_out(all_gather_result, fsdp_params, group):
    """FSDP2's `foreach_all_gather_copy_out`: nothing to copy after `_all_gather`."""
    if all_gather_result.all_gather_output is not None:
        return _originals["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)
    for work in all_gather_result.all_gather_work or ():
        work.wait()


def _reduce(fsdp_params, unsharded_grads, *args, **kwargs):
    """FSDP2's `foreach_reduce` (same arguments), called once per parameter on a TPU mesh.

    The unit's gradients are reduce-scattered as one (ranks, total) buffer which `_chunk_cat`
    fills column by column: on TPU, relayout loops over the whole unit, as for the all-gather
    (one Llama-1B layer on v5e:2x2: three loops over the embedding's, the output's and a block's
    gradients).  One call per parameter keeps all of FSDP2's semantics (its divide factors,
    reduce dtype, accumulation into `.grad`, post-accumulate hooks) with one collective each.
    Where one unit's call is not the sum of its parameters' (HSDP's all-reduce and its partial
    outputs, a user's all-reduce hook, a custom reduce-scatter, CPU offload), or the signature
    is not the one read here, FSDP2's own path runs."""
    original = _originals["foreach_reduce"]
    if len(fsdp_params) < 2 or not _reduce_per_parameter(fsdp_params, args, kwargs):
        return original(fsdp_params, unsharded_grads, *args, **kwargs)
    metrics.counters["fsdp_reduces_per_parameter"] += 1
    grads = list(unsharded_grads)
    unsharded_grads.clear()  # (FSDP2 frees the gradients by clearing the caller's list)
    for fsdp_param, grad in zip(fsdp_params, grads):
        result = original([fsdp_param], [grad], *args, **kwargs)
    # The last call's buffers and events: FSDP2 keeps them until its next reduce; the others'
    # are ordered by data dependence on tpu (no stream to protect them from).
    return result


def _reduce_per_parameter(fsdp_params, args, kwargs):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    try:
        bound = _reduce_signature.bind(fsdp_params, [], *args, **kwargs).arguments
    except TypeError:
        return False
    known = ("reduce_scatter_group", "reduce_scatter_comm", "all_reduce_group", "all_reduce_hook")
    if any(name not in bound for name in known):
        return False
    return (bound["all_reduce_group"] is None and bound["all_reduce_hook"] is None
            and type(bound["reduce_scatter_comm"]) is DefaultReduceScatter
            and not any(p.offload_to_cpu for p in fsdp_params)
            and _per_parameter_over(bound["reduce_scatter_group"]))
