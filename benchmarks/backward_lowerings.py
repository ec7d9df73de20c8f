"""Hand-written backward lowerings against what would replace them: PyTorch's decomposition of
the backward op (evaluated by the table's own lowerings, as `_lowerings/decomposed.py` does for
every op without a lowering) or the `jax.vjp` of the forward lowering (`_lowerings/gradients.py`).

    python benchmarks/backward_lowerings.py [--ops threshold_backward,...] [--repeat 3]

For each backward op, on tpu tensors the size of a small GPT's activations (float32, strict
eager): the first call of each variant's kernel, from empty caches (trace, PyTorch's
decomposition traced by make_fx where it is one, lowering and XLA compile: the warm-up cost),
and the steady time per call. Printed per repeat: `first ms / steady us` of each variant. The
variants run alternately, each through a kernel of its own from empty caches, after one
unprinted round that pays the process's one-time costs (make_fx's first trace...). Also, per
call, the torch CPU kernel's time and the formula written directly in JAX (under one jax.jit).
"""
import argparse
import os
import time

os.environ.setdefault("TORCHTPU_CACHE_DIR", "")  # cold compiles: no persistent cache

import jax  # noqa: E402
import torch  # noqa: E402
from torch._decomp import decomposition_table  # noqa: E402

import torchtpu  # noqa: E402,F401
from torchtpu._core import registry  # noqa: E402
from torchtpu._execution.op_kernel import OpKernel  # noqa: E402
from torchtpu._lowerings import decomposed, gradients  # noqa: E402

aten = torch.ops.aten


def _cases():
    """op -> (arguments on the CPU, the forward for a jax.vjp variant or None)."""
    g = torch.Generator().manual_seed(0)
    act = (8, 128, 1024)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    x, grad = randn(*act), randn(*act)
    scalar = torch.tensor(0.7)
    logits = randn(8, 4, 128, 128)
    ln_x = randn(8, 128, 256)
    ln_mean = ln_x.mean(-1, keepdim=True)
    ln_rstd = (ln_x.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    bn_x = randn(8, 64, 32, 32)
    bn_mean = bn_x.mean((0, 2, 3))
    bn_invstd = (bn_x.var((0, 2, 3), unbiased=False) + 1e-5).rsqrt()
    return {
        aten.threshold_backward.default: ((grad, x, 0.0), None),
        aten.leaky_relu_backward.default: ((grad, x, 0.01, False), None),
        aten.hardtanh_backward.default: ((grad, x, -1.0, 1.0), None),
        aten._softmax_backward_data.default:
            ((randn(*logits.shape), logits.softmax(-1), -1, torch.float32), None),
        aten._log_softmax_backward_data.default:
            ((randn(1024, 1024), randn(1024, 1024).log_softmax(-1), -1, torch.float32), None),
        aten.native_layer_norm_backward.default:
            ((randn(*ln_x.shape), ln_x, [256], ln_mean, ln_rstd, randn(256), randn(256),
              [True, True, True]), None),
        aten.embedding_dense_backward.default:
            ((randn(8, 128, 256), torch.randint(0, 1024, (8, 128), generator=g), 1024, -1,
              False), None),
        aten.mse_loss_backward.default: ((scalar, x, randn(*act), 1), aten.mse_loss.default),
        aten.smooth_l1_loss_backward.default:
            ((scalar, x, randn(*act), 1, 1.0), aten.smooth_l1_loss.default),
        aten.huber_loss_backward.default:
            ((scalar, x, randn(*act), 1, 1.0), aten.huber_loss.default),
        aten.native_dropout_backward.default: ((grad, randn(*act) > 0, 2.0), None),
        aten.native_batch_norm_backward.default:
            ((randn(*bn_x.shape), bn_x, randn(64), None, None, bn_mean, bn_invstd, True, 1e-5,
              [True, True, True]), None),
        aten.softshrink_backward.default: ((grad, x, 0.5), aten.softshrink.default),
        aten.hardshrink_backward.default: ((grad, x, 0.5), aten.hardshrink.default),
    }


def _variants(op, forward):
    found = {"formula": registry.TABLE[op]}
    if op in decomposition_table:
        found["decomposition"] = registry.Lowering(
            fn=decomposed.make_lowering(op, decomposition_table[op]),
            static=decomposed._numbers(op), precision=True)
    if forward is not None:
        # (the forward may be a decomposition, traced with its numbers as constants)
        found["vjp"] = registry.Lowering(fn=gradients._input_backward(forward),
                                         static=decomposed._numbers(op))
    return found


def _to_tpu(v):
    return v.to("tpu") if isinstance(v, torch.Tensor) else v


def _time(kernel, args, n):
    # The results are held until the wait: the wait is for the live outputs of the calls.
    torch.tpu.synchronize()
    t0 = time.perf_counter()
    out = kernel(*args)
    torch.tpu.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = [kernel(*args) for _ in range(n)]
    torch.tpu.synchronize()
    del out
    return first * 1e3, (time.perf_counter() - t0) / n * 1e6


def _jax_us(fn, args, n):
    """The formula as a jax.jit of its tensor arguments (the rest are constants)."""
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*arrays):
        full = list(args)
        for i, a in zip(tensors, arrays):
            full[i] = a
        return fn(*full)

    f = jax.jit(call)
    arrays = [jax.numpy.asarray(args[i].numpy()) for i in tensors]
    jax.block_until_ready(f(*arrays))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*arrays)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e6


def _cpu_us(op, args, n):
    op(*args)
    t0 = time.perf_counter()
    for _ in range(n):
        op(*args)
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="", help="comma list of backward op names (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    wanted = set(filter(None, args.ops.split(",")))
    print(f"torch {torch.__version__}, jax {jax.__version__}, platform "
          f"{jax.devices()[0].platform}; first call ms (cold) / steady us per call")
    for op, (cpu_args, forward) in _cases().items():
        name = op._schema.name.split("::")[1]
        if wanted and name not in wanted:
            continue
        tpu_args = [_to_tpu(a) for a in cpu_args]
        variants = _variants(op, forward)
        rows = {v: [] for v in variants}
        for i in range(args.repeat + 1):  # the first round pays one-time costs: not shown
            for variant, low in variants.items():
                torchtpu.clear_caches()
                jax.clear_caches()  # every variant compiles from scratch
                timing = _time(OpKernel(op, low), tpu_args, args.calls)
                if i:
                    rows[variant].append(timing)
        cells = "   ".join(
            f"{v} " + ", ".join(f"{f:.0f}/{s:.0f}" for f, s in r) for v, r in rows.items())
        print(f"{name:32s} {cells}   torch CPU {_cpu_us(op, cpu_args, args.calls):.0f} us, "
              f"JAX {_jax_us(variants['formula'].fn, cpu_args, args.calls):.0f} us")


if __name__ == "__main__":
    main()
