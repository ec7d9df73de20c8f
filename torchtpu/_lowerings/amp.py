"""The two ops torch.amp.GradScaler uses: unscale-and-check gradients, update the scale."""
import jax.numpy as jnp

from .._core.registry import lowering


@lowering("aten::_amp_foreach_non_finite_check_and_unscale_")
def non_finite_check_and_unscale_(grads, found_inf, inv_scale):
    # Returns the new values of the mutated arguments: every gradient, then found_inf.
    bad = jnp.zeros((), bool)
    for g in grads:
        bad = bad | ~jnp.isfinite(g).all()
    unscaled = [(g * inv_scale.reshape(()).astype(g.dtype)) for g in grads]
    return (*unscaled, jnp.where(bad, jnp.ones_like(found_inf), found_inf))


@lowering("aten::_amp_update_scale_")
def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    found = found_inf.reshape(()) > 0
    grown = growth_tracker + 1
    grow_now = grown >= growth_interval
    new_scale = jnp.where(found, scale * backoff_factor,
                          jnp.where(grow_now, scale * growth_factor, scale))
    new_tracker = jnp.where(found | grow_now, jnp.zeros_like(growth_tracker), grown)
    return new_scale.astype(scale.dtype), new_tracker.astype(growth_tracker.dtype)
