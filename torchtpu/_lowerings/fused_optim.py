"""The fused optimizer steps torch.optim calls with `fused=True` (`_fused_adam_`, `_fused_adamw_`,
`_fused_sgd_`, `_fused_adagrad_`): one executable updates every parameter and its state.

Each lowering returns the new values of the mutated lists in schema order (params, grads, then
the state). As PyTorch's CPU and CUDA kernels do: with `grad_scale` the gradients are unscaled
in place and the step uses them; with `found_inf == 1` (GradScaler saw an inf/NaN) nothing
changes, not even the gradients; half-precision values are updated in float32 and rounded once.
`lr` is traced, not a compile-time constant: a scheduler changes it every step, which must not
recompile. The `tensor_lr` overloads pass it as a tensor, read the same way.
"""
import jax.numpy as jnp
import torch

from .meta import dtype_name
from .._core.registry import lowering


def _register(op, validate, traced=("lr",)):
    return lowering(f"aten::{op}", f"aten::{op}.tensor_lr", traced=traced, opmath=True,
                    validate=validate)


def _check(kernel, params, lists, steps, grad_scale, found_inf):
    """PyTorch's errors for a fused step's arguments: every list (by name) holds one tensor per
    parameter, of its floating dtype; grad_scale and found_inf are float32."""
    for name, xs in (*lists.items(), ("state_steps", steps or params)):
        if len(xs) != len(params):
            raise RuntimeError(f"Expected {name}.size() == n_tensors to be true, but got false.  "
                               "(Could this error message be improved?  If so, please report an "
                               "enhancement request to PyTorch.)")
    expected = [(p.dtype, t.dtype) for xs in lists.values() for p, t in zip(params, xs)]
    expected += [(torch.float32, t.dtype) for t in (grad_scale, found_inf) if t is not None]
    for p in params:
        if not p.is_floating_point():
            raise NotImplementedError(f'"{kernel}" not implemented for \'{dtype_name(p.dtype)}\'')
    for want, got in expected:
        if want != got:
            raise RuntimeError(f"expected scalar type {dtype_name(want)} but found {dtype_name(got)}")


def _scalar(t):
    return t.reshape(()) if hasattr(t, "reshape") else t


def _fused_step(params, grads, states, grad_scale, found_inf, update, reads=()):
    """[params, grads, *states] after `update(p, g, *state, *read) -> (p, *state)` per parameter,
    `g` the unscaled gradient (also what the grads become)."""
    unscaled = grads if grad_scale is None else [g / _scalar(grad_scale) for g in grads]
    old = [params, grads, *states]
    new = [[] for _ in old]
    for p, g, *rest in zip(params, unscaled, *states, *reads):
        p, *state = update(p, g, *rest)
        for column, value in zip(new, (p, g, *state)):
            column.append(value)
    if found_inf is None:
        return new
    # PyTorch's kernels test found_inf == 1 (GradScaler writes 0 or 1), not != 0.
    skip = _scalar(found_inf) == 1
    return [[jnp.where(skip, a, b) for a, b in zip(olds, news)] for olds, news in zip(old, new)]


def _adam(adamw):
    def fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                   beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        lr = _scalar(lr)

        def update(p, g, m, v, *rest):
            *vmax, step = rest
            if maximize:
                g = -g
            if weight_decay != 0:
                if adamw:
                    p = p * (1 - lr * weight_decay)
                else:
                    g = g + weight_decay * p
            m = m + (g - m) * (1 - beta1)
            v = v * beta2 + (1 - beta2) * g * g
            vmax = [jnp.maximum(vmax[0], v)] if amsgrad else []
            denom = jnp.sqrt(vmax[0] if amsgrad else v) / jnp.sqrt(1 - beta2 ** step) + eps
            return (p - lr / (1 - beta1 ** step) * m / denom, m, v, *vmax)

        # Without amsgrad torch.optim passes no max_exp_avg_sqs (an empty list).
        states = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
        return _fused_step(params, grads, states, grad_scale, found_inf, update, [state_steps])

    return fused_adam


def _validate_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                   beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    lists = dict(grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    _check("fused_adam_kernel", params, lists, state_steps, grad_scale, found_inf)


_register("_fused_adam_", _validate_adam)(_adam(adamw=False))
_register("_fused_adamw_", _validate_adam)(_adam(adamw=True))


def _validate_sgd(params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening,
                  nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
    lists = dict(grads=grads, momentum_buffer_list=momentum_buffer_list) if momentum != 0 else \
        dict(grads=grads)
    _check("fused_sgd_kernel", params, lists, None, grad_scale, found_inf)


def _validate_adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps,
                      maximize, grad_scale=None, found_inf=None):
    _check("fused_adagrad_kernel", params, dict(grads=grads, state_sums=state_sums), state_steps,
           grad_scale, found_inf)


@_register("_fused_sgd_", _validate_sgd, traced=("lr", "is_first_step"))
def fused_sgd(params, grads, momentum_buffer_list, weight_decay, momentum, lr, dampening, nesterov,
              maximize, is_first_step, grad_scale=None, found_inf=None):
    lr = _scalar(lr)

    def update(p, g, *buf):
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            # torch.optim creates the buffers uninitialised before the first step.  The flag
            # is traced, so the first step is the same executable as the later ones.
            b = jnp.where(is_first_step, g, buf[0] * momentum + (1 - dampening) * g)
            g = g + momentum * b if nesterov else b
            buf = (b,)
        return (p - lr * g, *buf)

    # Without momentum torch.optim passes no buffers (an empty list).
    states = [momentum_buffer_list] if momentum != 0 else []
    return _fused_step(params, grads, states, grad_scale, found_inf, update)


@_register("_fused_adagrad_", _validate_adagrad)
def fused_adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
                  grad_scale=None, found_inf=None):
    lr = _scalar(lr)

    def update(p, g, total, step):
        if maximize:
            g = -g
        if weight_decay != 0:
            g = g + weight_decay * p
        total = total + g * g
        clr = lr / (1 + (step - 1) * lr_decay)
        return p - clr * g / (jnp.sqrt(total) + eps), total

    new = _fused_step(params, grads, [state_sums], grad_scale, found_inf, update, [state_steps])
    # The float-lr overload declares state_steps mutable though no kernel writes them (torch.optim
    # counts the steps itself): they keep their values. The tensor_lr overload does not list
    # them among its outputs, and the executor ignores results beyond the mutated arguments.
    return (*new, state_steps)
