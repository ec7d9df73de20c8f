"""torchtpu.scaling: the projection to TPU slices, checked against a published analysis."""
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


def test_the_step_program_costs_what_the_formulas_say():
    # The step recorded without memory and compiled for this machine: its FLOPs (XLA's cost
    # analysis, 1- and 2-layer steps extrapolated to 3) within 5% of 6 per parameter and token
    # plus attention.
    config = dict(vocab=512, d=256, layers=3, heads=4, kv_heads=2, hidden=704)
    compiled = scaling.program_cost(config, seq=64, batch=2)
    formula = scaling.analytic_cost(config, seq=64, batch=2)
    assert abs(compiled.flops / formula.flops - 1) < 0.05, (compiled.flops, formula.flops)
    assert compiled.params == formula.params


def test_the_command_prints_fsdp_and_hsdp(capsys):
    assert scaling.main(["--model", "llama-1b", "--analytic", "--slice", "v5e-256",
                         "--hsdp", "2", "--seq", "2048", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "a model, not a measurement" in out
    assert "FSDP x1 (256 chips)" in out and "HSDP x2 (512 chips)" in out
    assert "cloud.google.com/tpu/docs/v5e" in out
