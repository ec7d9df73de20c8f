"""torchtpu.scaling: the projection to TPU slices, checked against a published analysis."""
import pytest

import torchtpu  # noqa: F401
from torchtpu import scaling


def test_fsdp_turns_compute_bound_where_the_published_analysis_says():
    # Austin et al., "How to Scale Your Model" (2025), part 5: FSDP is compute-bound above
    # C / W_ici tokens per chip, 2,550 on one v5p ICI axis and 850 on all three.  This model,
    # from Google's published chip figures, puts the thresholds within 15% of those.
    v5p = scaling.CHIPS["v5p"]
    assert abs(scaling.critical_tokens_per_chip(v5p, axes=1) / 2550 - 1) < 0.15
    assert abs(scaling.critical_tokens_per_chip(v5p, axes=3) / 850 - 1) < 0.15
    # ...and the projection agrees with itself: at the threshold (compute-bound FLOPs only)
    # communication equals compute, and efficiency falls fast below it.
    config = dict(scaling.MODELS["llama-8b"])
    params, _ = scaling._sizes(config)
    for factor, lowest, highest in ((4, 0.9, 1.0), (1, 0.8, 1.0), (0.25, 0.2, 0.35)):
        tokens = scaling.critical_tokens_per_chip(v5p, axes=3, grad_bytes=4) * factor
        program = scaling.Program(flops=6 * params * tokens, bytes=0, params=params,
                                  layer_params=params // config["layers"])
        p = scaling.project(program, v5p, 1024, layers=config["layers"])
        assert lowest <= p.efficiency <= highest, (factor, p)


def test_slices_name_their_tpu_topologies():
    assert scaling.topology_of("v5e-256") == "v5e:16x16"
    assert scaling.topology_of("v5e-8") == "v5e:2x4"
    assert scaling.topology_of("v6e-64") == "v6e:8x8"
    assert scaling.topology_of("v5p-1024") == "v5p:8x8x8"  # (TensorCores: 512 chips)
    assert scaling.topology_of("v5e:4x4") == "v5e:4x4"
    assert scaling._chips("v5p:8x8x8") == scaling._chips("v5p-1024") == ("v5p", 512)
    with pytest.raises(ValueError, match="power-of-two"):
        scaling.topology_of("v5e-12")


TINY = scaling.MODELS["tiny"]


@pytest.fixture(scope="module")
def tiny_step():
    """Rank 0's FSDP2 steps of the tiny Llama on a 4-chip v5e slice, by layers (those the
    command samples)."""
    return {n: scaling.fsdp_step_report(TINY, "v5e:2x2", n, 128, 2) for n in scaling.SAMPLED}


def test_the_fsdp2_step_is_compiled_for_the_slice_with_its_collectives(tiny_step):
    layers = max(tiny_step)
    report = tiny_step[layers]
    assert not report.error, report.error
    # What FSDP2 issues, with torchtitan's units (the embedding, the blocks and the output
    # gathered in the forward, all blocks but the last again in the backward), on a TPU mesh
    # one all-gather and one reduce-scatter per parameter (_distributed/fsdp.py), the
    # reduce-scatters compiled by libtpu as all-reduces (JAX's own FSDP step's too, combined in
    # a step this small); the schedule overlaps some all-gathers with compute.
    count, overlapped = report.collectives["all-gather"]
    assert count >= 6 * layers and overlapped >= 3, report.collectives
    # No copy into or out of a unit's gathered buffer (FSDP2's copy-in and copy-out made 38
    # dynamic-update-slices of this step; what is left are attention's, two per layer).
    assert report.text.count("dynamic-update-slice(") <= 2 * layers
    assert set(report.collectives) <= {"all-gather", "all-reduce", "reduce-scatter"}
    # The unsharded parameters and the gather/scatter buffers are the program's temporaries:
    # its inputs are the shards, AdamW's state and the tokens (about 3 x 4 bytes x 105k
    # parameters / 4 chips), not the whole model.
    params, _ = scaling._sizes(dict(TINY, layers=layers))
    assert report.argument_bytes < 3 * 4 * params / 4 * 1.5 + 2**20, report.argument_bytes
    sent, _ = report.collective_bytes["all-gather"]
    assert sent > 0


def test_a_projected_group_records_but_runs_nothing():
    import torch
    import torch.distributed as dist
    from torchtpu._core import tpu_compiler
    from torchtpu._distributed.process_group import projected_world
    with projected_world(tpu_compiler.topology("v5e:2x2")):
        assert dist.get_world_size() == 4 and dist.get_rank() == 0
        with pytest.raises(RuntimeError, match="projected group"):
            dist.all_reduce(torch.ones(3))  # (CPU tensors: the group's gloo side)
    assert not dist.is_initialized()


def test_the_compiled_summary_extrapolates_and_fits(tiny_step, monkeypatch):
    monkeypatch.setattr(scaling, "fsdp_step_report",
                        lambda config, target, layers, seq, batch, checkpoint=False: tiny_step[layers])
    config = dict(TINY, layers=5)
    compiled = scaling.compiled_cost(config, "v5e:2x2", 128, 2, report=scaling.fsdp_step_report)
    (a, first), (b, last) = sorted(tiny_step.items())
    per_layer = (last.hbm_bytes - first.hbm_bytes) / (b - a)
    assert compiled.hbm == pytest.approx(first.hbm_bytes + (5 - a) * per_layer)
    per_layer = (last.optimal_seconds - first.optimal_seconds) / (b - a)
    assert compiled.roofline == pytest.approx(first.optimal_seconds + (5 - a) * per_layer)
    s = scaling.scheduled(compiled, scaling.CHIPS["v5e"], scaling.analytic_cost(config, 128, 2).flops)
    assert s.step >= s.compute > 0 and 0 <= s.exposed <= s.collectives
    assert 0 < s.utilisation < 1


def test_the_command_prints_fsdp_and_hsdp(capsys):
    assert scaling.main(["--model", "llama-1b", "--analytic", "--slice", "v5e-256",
                         "--hsdp", "2", "--seq", "2048", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "a model, not a measurement" in out
    assert "FSDP x1 (256 chips)" in out and "HSDP x2 (512 chips)" in out
    assert "cloud.google.com/tpu/docs/v5e" in out


def test_the_command_compiles_the_step_for_the_slice(capsys, tmp_path):
    out_json = tmp_path / "slices.json"
    assert scaling.main(["--model", "tiny", "--slice", "v5e:2x2", "--seq", "128", "--batch",
                         "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "compiled for v5e:2x2: HBM" in out and "largest batch" in out
    assert "(analytic model)" in out
    import json
    row, = json.loads(out_json.read_text())["slices"]
    assert row["fits"] and row["largest_batch"] >= 2 and row["step"] > 0


def test_full_compiles_every_layer_once():
    row = scaling.compiled_summary(TINY, "v5e:2x2", 128, 2, fit=False, full=True)
    assert row["layers_compiled"] == [TINY["layers"]] and row["fits"]
    assert "largest_batch" not in row and row["step"] >= row["roofline"] > 0
