"""Reading and writing views through their storage's array (torchtpu._execution.strided): views
at a known offset are slices of the array's own dims (split where the view's strides fall
inside them), everything else goes through the flat array; both against PyTorch's CPU views;
and a captured step reads its views so, with its offsets and numbers baked in."""
import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu._execution import strided


def _random_view(rng, t):
    """`t` (a contiguous CPU tensor over its storage) through a few random view ops."""
    for _ in range(rng.randint(1, 3)):
        k = rng.randint(0, 7)
        if k == 0 and t.dim() > 0:
            d = rng.randrange(t.dim())
            if t.shape[d] > 1:
                lo = rng.randrange(t.shape[d])
                t = t.narrow(d, lo, rng.randint(lo + 1, t.shape[d]) - lo)
                t = t[(slice(None),) * d + (slice(None, None, rng.randint(1, 2)),)]
        elif k == 1 and t.dim() > 1:
            t = t.transpose(rng.randrange(t.dim()), rng.randrange(t.dim()))
        elif k == 2 and t.dim() > 0 and t.shape[0]:
            d = rng.randrange(t.dim())
            t = t.select(d, rng.randrange(t.shape[d]))
        elif k == 3:
            t = t.unsqueeze(rng.randint(0, t.dim()))
        elif k == 4 and t.dim() > 0:
            d = rng.randrange(t.dim())
            if t.shape[d] == 1:
                t = t.expand(*[3 if i == d else -1 for i in range(t.dim())])
        elif k == 5 and t.dim() > 0 and t.shape[-1] % 2 == 0 and t.stride(-1) == 1:
            t = t.chunk(2, -1)[rng.randrange(2)]
        elif k == 6 and t.is_contiguous() and t.numel() > 1:
            f = t.reshape(-1)
            lo = rng.randrange(f.numel())
            t = f[lo:rng.randint(lo + 1, f.numel())]
            if rng.random() < 0.5 and t.numel() % 2 == 0:
                t = t.view(2, -1)
        elif k == 7 and t.dim() > 0 and t.shape[-1] >= 2:
            t = t.unfold(t.dim() - 1, 2, 1)  # overlapping windows: the flat path
    return t


def test_reads_and_writes_of_random_views_match_pytorch():
    rng = random.Random(0)
    on_dims = 0
    for _ in range(500):
        shape = tuple(rng.choice([1, 2, 3, 4, 5, 6]) for _ in range(rng.randint(1, 4)))
        base = torch.arange(int(np.prod(shape)), dtype=torch.float32)
        view = _random_view(rng, base.view(shape))
        size, stride, offset = tuple(view.shape), view.stride(), view.storage_offset()
        # The storage's array: of the tensor's shape, flat, or with its leading dims merged.
        array_shape = rng.choice([shape, (base.numel(),),
                                  (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else shape])
        array = jnp.asarray(base.numpy().reshape(array_shape))
        on_dims += strided._plan(array_shape, size, stride, offset) is not None
        got = np.asarray(strided.read(array, size, stride, offset, jnp.float32))
        np.testing.assert_array_equal(got, view.numpy(), err_msg=f"{array_shape} {size} {stride} {offset}")
        if view.numel() and torch._debug_has_internal_overlap(view) == 0:
            value = torch.rand(size)
            expected = base.clone()
            torch.as_strided(expected, size, stride, offset).copy_(value)
            written = strided.write(array, size, stride, offset, jnp.float32, jnp.asarray(value.numpy()))
            assert written.shape == array.shape
            np.testing.assert_array_equal(np.asarray(written).reshape(-1), expected.numpy())
    assert 300 < on_dims < 500  # both paths were taken


def test_a_chunk_of_a_matmul_is_a_slice_of_its_dims():
    """The Llama MLP's `gate_up(x).chunk(2, -1)`: halves of each row of a [B*T, 2H] result,
    read as [B, T, H] views, are static slices of the (split) array, not of a flat copy."""
    import jax
    array = jax.ShapeDtypeStruct((1024, 1408), jnp.float32)
    text = jax.jit(lambda a: strided.read(a, (8, 128, 704), (180224, 1408, 1), 704, jnp.float32)
                   ).lower(array).as_text()
    assert "dynamic_slice" not in text and "tensor<1441792xf32>" not in text
    assert strided._plan((1024, 1408), (8, 128, 704), (180224, 1408, 1), 704)[0] == (8, 128, 1408)


def test_a_captured_step_bakes_its_offsets_and_numbers_in():
    """A torch.tpu graph runs with its capture's numbers: its views' offsets are constants of
    its program (static slices, no 64-bit offset arguments), and it still computes what eager
    does, replay after replay."""
    def make_step(w, x):
        opt = torch.optim.SGD([w], lr=0.1)

        def step():
            opt.zero_grad(set_to_none=False)
            gate, up = (x @ w).chunk(2, -1)
            loss = (torch.nn.functional.silu(gate) * up).mean()
            loss.backward()
            opt.step()
            return loss
        return step

    w = torch.randn(16, 8, device="tpu", requires_grad=True)
    x = torch.randn(4, 16, device="tpu")
    step = make_step(w, x)
    ref_w = w.detach().cpu().clone().requires_grad_()
    ref_step = make_step(ref_w, x.cpu())

    for _ in range(2):
        step(), ref_step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):  # (records the step: runs nothing, as CUDA's capture)
        out = step()
    for _ in range(3):
        g.replay()
        expected = ref_step()
        torch.testing.assert_close(out.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.detach().cpu(), ref_w.detach(), rtol=1e-5, atol=1e-6)
    arrays = [b.value() for b in g.input_storages]
    text = g._segment.lower(arrays, g._scalars.for_run()).as_text()
    assert "dynamic_slice" not in text  # the chunk's second half at offset 4: a static slice


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_weights_placed_by_to_empty_keep_their_shape(mode):
    """A model built on `meta`, placed by `to_empty` and initialised in place (torchtitan's
    way) has storages of its weights' shapes, as one built on the device has: the zeros of an
    unwritten storage take the shape of the tensor `empty` made it for, and a storage keeps its
    array's shape through writes (flat, every read of a weight as a matrix was a relayout copy
    on TPU).  The abstract capture of a step (torchtpu.scaling) describes them so too."""
    from torchtpu._core import storage
    from torchtpu._execution import recording
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        with torch.device("meta"):
            m = torch.nn.Linear(16, 8)
        m = m.to_empty(device="tpu")
        torch.nn.init.normal_(m.weight)
        with torch.no_grad():
            m.weight.add_(1)
        torch.tpu.synchronize()
        assert storage.buffer_or_none(m.weight).value().shape == (8, 16)
        assert -6 < float(m.weight.mean()) - 1 < 6
        with torch.device("meta"):
            fresh = torch.nn.Linear(16, 8)
        fresh = fresh.to_empty(device="tpu")
        capture = recording.start_capture(torch.tpu.current_device(), by_storage=True, abstract=True)
        try:
            fresh(torch.ones(2, 16, device="tpu")).sum()
        finally:
            recorded = recording.stop_capture(*capture)
        try:
            shapes = {tuple(a.shape) for a in recorded.inputs}
            assert (8, 16) in shapes and (128,) not in shapes
        finally:
            recorded.release()
