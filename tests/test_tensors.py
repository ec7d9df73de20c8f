import copy
import io

import pytest
import torch

from conftest import assert_same, counts


def both(fn, *tensors):
    return fn(*[t.to("tpu") for t in tensors]), fn(*tensors)


def test_transfers_and_conversions():
    a = torch.randn(3, 4)
    t = a.to("tpu")
    assert t.device.type == "tpu" and torch.equal(t.cpu(), a)
    assert torch.equal(a.to("tpu", torch.float16).cpu(), a.half())
    assert torch.equal(t.to(torch.bfloat16).cpu(), a.bfloat16())
    assert t.to(torch.int32).dtype == torch.int32
    assert torch.equal(torch.tensor([[1, 2], [3, 4]], device="tpu").cpu(), torch.tensor([[1, 2], [3, 4]]))
    assert t[1, 2].item() == a[1, 2].item()
    assert t.tolist() == a.tolist()
    out = torch.empty(3, 4)
    out.copy_(t, non_blocking=True)
    assert torch.equal(out, a)
    dst = torch.zeros(3, 4, device="tpu", dtype=torch.float64)
    dst.copy_(a)
    assert torch.equal(dst.cpu(), a.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.uint8, torch.int8, torch.bool,
                                   torch.complex64, torch.float64])
def test_dtype_roundtrip(dtype):
    a = (torch.randn(5, 3) * 10).to(dtype)
    t = a.to("tpu")
    assert t.dtype == dtype
    assert torch.equal(t.cpu(), a)


def test_repr_shows_device():
    t = torch.tensor([1.5, 2.0], device="tpu")
    assert "device='tpu:0'" in repr(t)
    assert "1.5000" in str(t)


def test_numpy_refused_like_cuda():
    t = torch.ones(2, device="tpu")
    with pytest.raises(TypeError, match="can't convert tpu:0 device type tensor to numpy"):
        t.numpy()


def test_save_load_roundtrip():
    m = torch.nn.Linear(3, 2).to("tpu")
    buf = io.BytesIO()
    torch.save({"sd": m.state_dict(), "t": torch.arange(4.0, device="tpu")[1:]}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["t"].device.type == "tpu" and loaded["t"].cpu().tolist() == [1.0, 2.0, 3.0]
    assert torch.equal(loaded["sd"]["weight"].cpu(), m.weight.detach().cpu())
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu"
    buf2 = io.BytesIO()
    torch.save(on_cpu["sd"], buf2)
    buf2.seek(0)
    assert torch.load(buf2, map_location="tpu")["bias"].device.type == "tpu"


# --- aliasing: every view shares storage and sees in-place writes ----------------------------

def test_views_have_pytorch_metadata():
    a = torch.arange(24.0).reshape(2, 3, 4)
    t = a.to("tpu")
    for f in [lambda x: x.t() if x.dim() == 2 else x.transpose(0, 2), lambda x: x[:, 1:, ::2],
              lambda x: x.permute(2, 0, 1), lambda x: x.select(1, 2), lambda x: x.unsqueeze(0),
              lambda x: x.view(6, 4), lambda x: x.diagonal(0, 1, 2), lambda x: x[1].unfold(1, 2, 1),
              lambda x: x.expand(3, -1, -1, -1), lambda x: x.narrow(2, 1, 2)]:
        v, r = f(t), f(a)
        assert v._is_view() and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert_same(v, r)


@pytest.mark.parametrize("name,fn", [
    ("t_row_add", lambda x: x.t()[0].add_(1)),
    ("strided_mul", lambda x: x[:, 1::2].mul_(2)),
    ("flat_zero", lambda x: x.view(-1).zero_()),
    ("diag_fill", lambda x: x.diagonal().fill_(0)),
    ("col_copy", lambda x: x[:, 0].copy_(torch.tensor([7.0, 8.0, 9.0, 10.0]))),
    ("slice_sub", lambda x: x[1:3, 1:].sub_(x[0, 1:])),
    # a block of the dense layout around the view (strided._write_strided), past the
    # storage's end; half of each permuted row, as RoPE's backward writes
    ("corner_add", lambda x: x[2:, 3:].add_(1)),
    ("permuted_halves", lambda x: x.view(2, 2, 2, 2).transpose(1, 2)[..., 1:].mul_(3)),
])
def test_inplace_through_views(name, fn):
    a = torch.arange(16.0).reshape(4, 4)
    t = a.to("tpu")
    fn(t)
    fn(a)
    assert torch.equal(t.cpu(), a)


def test_expanded_view_reads():
    a = torch.arange(4.0)
    t = a.to("tpu")
    e, r = t.unsqueeze(0).expand(3, -1), a.unsqueeze(0).expand(3, -1)
    assert e.stride() == r.stride() == (0, 1)
    assert torch.equal(e.cpu(), r)
    assert torch.equal((e * 2).cpu(), r * 2)
    t.add_(1)
    assert torch.equal(e.cpu(), r + 1)


def test_overlapping_copy_raises_like_cpu():
    t = torch.arange(10.0, device="tpu")
    before = t.cpu().clone()
    with pytest.raises(RuntimeError, match="unsupported operation"):
        t[1:].copy_(t[:-1])
    assert torch.equal(t.cpu(), before)


def test_copy_between_disjoint_views_of_one_storage():
    a = torch.arange(10.0)
    t = a.to("tpu")
    t[5:].copy_(t[:5])
    a[5:].copy_(a[:5])
    assert torch.equal(t.cpu(), a)


def test_inplace_on_leaf_requiring_grad_errors():
    w = torch.ones(3, device="tpu", requires_grad=True)
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        w.add_(1)


def test_out_argument_resizes_and_keeps_identity():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = torch.empty(0, device="tpu")
    r = torch.add(a.to("tpu"), b.to("tpu"), out=out)
    assert r is out and out.shape == (3, 4)
    torch.testing.assert_close(out.cpu(), a + b)


def test_resize_preserves_values():
    t = torch.arange(4.0, device="tpu")
    t.resize_(8)
    assert t.shape == (8,) and t[:4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


# Storages swap data pointers (UntypedStorage._swap_data_ptr_, torch 2.12+), or run as on 2.11.
RELEASES_SWAPPING_STORAGES = [
    pytest.param(True, id="torch>=2.12", marks=pytest.mark.skipif(
        not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="torch 2.11 cannot")),
    pytest.param(False, id="torch2.11")]


@pytest.mark.parametrize("in_place", RELEASES_SWAPPING_STORAGES)
def test_resize_where_storages_can_or_cannot_resize_in_place(monkeypatch, in_place):
    # torch 2.11 has no UntypedStorage._swap_data_ptr_: a growing tensor moves to a new
    # storage there, and a storage's own resize_ refuses with a clear error.
    from torchtpu._core import storage
    monkeypatch.setattr(storage, "RESIZES_IN_PLACE", in_place)
    t = torch.arange(4.0, device="tpu")
    t.resize_(2, 4)
    assert t.shape == (2, 4) and t.view(-1)[:4].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = torch.empty(2, device="tpu")
    assert torch.add(a.to("tpu"), b.to("tpu"), out=out) is out
    torch.testing.assert_close(out.cpu(), a + b)
    st = torch.ones(4, device="tpu").untyped_storage()
    if in_place:
        st.resize_(0)
        assert st.nbytes() == 0
    else:
        with pytest.raises(RuntimeError, match="needs torch 2.12 or newer"):
            st.resize_(0)
        assert st.nbytes() == 16


@pytest.mark.parametrize("swaps", RELEASES_SWAPPING_STORAGES)
def test_new_outputs_have_pytorch_layouts_storage_sizes_and_disjoint_addresses(monkeypatch, swaps):
    # An op's new contiguous output on tpu:0 takes its storage by a swap of data pointers
    # (storage.wrap), any other by set_: both must give PyTorch's layout and storage size, and
    # no two live storages may overlap, small (a counter's slots) or large (a bumped address).
    from torchtpu._core import storage
    monkeypatch.setattr(storage, "RESIZES_IN_PLACE", swaps)
    cases = {
        "small": lambda x: x * 2,
        "large": lambda x: x.repeat(40, 40) + 1,  # 64x64x40x40 float32: 26 MB
        "transposed": lambda x: x.t() * 1,  # strides follow the input's: (1, 64)
        "empty": lambda x: x[:0] * 2,
        "scalar": lambda x: x.sum(),
        "int64": lambda x: (x > 0).long(),
    }
    x_cpu = torch.randn(64, 64)
    x = x_cpu.to("tpu")
    outs = {name: (fn(x), fn(x_cpu)) for name, fn in cases.items()}  # (in each eager mode)
    spans = []
    for name, (t, c) in outs.items():
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == (
            c.shape, c.stride(), c.storage_offset(), c.dtype), name
        st = t.untyped_storage()
        assert st.nbytes() == c.untyped_storage().nbytes() and st.device == t.device, name
        assert t.is_contiguous() == c.is_contiguous(), name
        torch.testing.assert_close(t.cpu(), c)
        spans.append((st.data_ptr(), st.data_ptr() + max(st.nbytes(), 1), name))
    spans.append((x.untyped_storage().data_ptr(), x.untyped_storage().data_ptr() + 16384, "x"))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, f"the storages of {a} and {b} overlap"


def test_dtype_view_shares_bits():
    a = torch.randn(4)
    t = a.to("tpu")
    assert torch.equal(t.view(torch.int32).cpu(), a.view(torch.int32))


def test_data_dependent_ops_synchronise():
    a = torch.tensor([0.0, 1.5, 0.0, -2.0])
    t = a.to("tpu")
    assert torch.equal(t.nonzero().cpu(), a.nonzero())
    assert torch.equal(t[t != 0].cpu(), a[a != 0])
    assert bool((t > 1).any()) is True
    assert torch.equal(torch.masked_select(t, t < 0).cpu(), torch.tensor([-2.0]))


def test_device_copy_does_not_alias_the_host_tensor():
    a = torch.arange(6.0)
    t = a.to("tpu")
    a.add_(100)
    assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_tied_parameters_stay_tied_after_moving_to_tpu():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    model.to("tpu")
    assert model.head.weight is model.embed.weight
    assert model.head.weight.device.type == "tpu"
    assert len(list(model.parameters())) == 1


def test_moving_a_module_keeps_its_parameter_objects_and_optimizer():
    # As on CUDA: an optimizer built before the move (accelerate's prepare(model, optimizer))
    # steps the moved weights; a Parameter keeps its subclass and attributes.
    class Tagged(torch.nn.Parameter):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].weight = Tagged(model[1].weight.detach())
    model[1].weight.no_decay = True
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cpu = copy.deepcopy(model)
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.5)
    model.to("tpu")
    assert all(p is q and p.device.type == "tpu" for p, q in zip(model.parameters(), params, strict=True))
    assert type(model[1].weight) is Tagged and model[1].weight.no_decay
    x = torch.randn(4, 3)
    for m, o, dev in ((model, opt, "tpu"), (cpu, cpu_opt, "cpu")):
        m(x.to(dev)).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach())
    model.to("cpu").double()
    assert all(p is q and p.dtype == torch.float64 for p, q in zip(model.parameters(), params))


def test_conj_and_neg_bit_views_are_read_and_written_through():
    a = torch.randn(5, dtype=torch.complex64)
    t = a.to("tpu")
    torch.testing.assert_close((t.conj() * 2).cpu(), a.conj() * 2)
    torch.testing.assert_close((t.conj() + t).cpu(), a.conj() + a)
    torch.testing.assert_close(torch.ops.aten._neg_view(t).mul(3).cpu(), -a * 3)
    b, bt = a.clone(), t.clone()
    b.conj().add_(1j)
    bt.conj().add_(1j)
    torch.testing.assert_close(bt.cpu(), b)


def test_complex_storage_viewed_as_real_and_back():
    a = torch.randn(3, 4, dtype=torch.complex64)
    t = a.to("tpu")
    real = torch.view_as_real(t)
    torch.testing.assert_close(real.cpu(), torch.view_as_real(a))
    real[..., 1].mul_(-1)  # conjugate through the real view
    torch.testing.assert_close(t.cpu(), a.conj())
    x = torch.randn(3, 2)
    torch.testing.assert_close((torch.view_as_complex(x.to("tpu")) * 2).cpu(), torch.view_as_complex(x) * 2)


def test_ops_on_views_at_many_offsets_read_and_write_the_right_elements():
    # Nonzero offsets are runtime arguments of the executables: every layout of view below
    # reads and writes through a traced offset.
    x = torch.randn(7, 9)
    z = torch.randn(5, 4, dtype=torch.complex64)
    d, dz = x.to("tpu"), z.to("tpu")
    for i in range(1, 5):
        for fn in (lambda t: t[i], lambda t: t[:, i], lambda t: t.t()[i:i + 2, 1:4],
                   lambda t: t.view(-1)[i::5], lambda t: t[i:, i].unsqueeze(1).expand(-1, 3),
                   lambda t: t[i, 2:].flip(0)):
            assert_same(fn(d) * 3 + 1, fn(x) * 3 + 1)
        d[i, 1:].mul_(2)
        x[i, 1:].mul_(2)
        d.t()[i:i + 2, 2:5].add_(d[0, :3])
        x.t()[i:i + 2, 2:5].add_(x[0, :3])
        d.view(-1)[i::7].copy_(dz.real.reshape(-1)[i:i + len(range(i, 63, 7))])
        x.view(-1)[i::7].copy_(z.real.reshape(-1)[i:i + len(range(i, 63, 7))])
        assert_same(dz.conj()[i] * 2, z.conj()[i] * 2)
        assert_same(torch.view_as_real(dz[i:]).sum(0), torch.view_as_real(z[i:]).sum(0))
    assert_same(d, x)


def test_a_sequence_growing_by_appends_matches_the_cpu(monkeypatch):
    # Appends onto an appended result write into a storage with room to spare
    # (growing_sequences.py): values, strides, storage sizes, aliasing and gradients stay the
    # CPU's.
    from torchtpu._execution import growing_sequences
    monkeypatch.setattr(growing_sequences, "_MIN_FLAT", 64)
    x = torch.arange(6).view(1, 6)
    d = x.to("tpu")
    kept = []
    for step in range(70):  # past the first capacity (64 elements)
        if step % 5 == 4:  # an element of the sequence itself (a view of its storage)
            x = torch.cat([x, x[:, 2:3]], dim=1)
            d = torch.cat([d, d[:, 2:3]], dim=1)
        x = torch.cat([x, (x[:, -1:] * 7 + step) % 101], dim=-1)
        d = torch.cat([d, (d[:, -1:] * 7 + step) % 101], dim=-1)
        assert d.untyped_storage().nbytes() == x.untyped_storage().nbytes()
        if step % 9 == 0:
            assert_same(d, x)
            kept.append((d, x.clone()))
    for got, want in kept:  # earlier results are not changed by later appends
        assert_same(got, want)
    d[0, 3] = -1  # writing into the result leaves what it was appended from alone
    assert_same(kept[-1][0], kept[-1][1])
    assert d[0, 3].item() == -1
    kept[-1][0][0, 5] = -2  # and the other way round
    assert d[0, 5].item() == x[0, 5].item()
    buffer = io.BytesIO()
    torch.save(d, buffer)
    assert_same(torch.load(io.BytesIO(buffer.getvalue())), torch.cat([x[:, :3], x.new_full((1, 1), -1), x[:, 4:]], 1))
    # along dim 0 of a 1-D sequence, with a float tensor and its gradient
    w, v = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    wt, vt = w.detach().to("tpu").requires_grad_(), v.detach().to("tpu").requires_grad_()
    a, at = w * 1, wt * 1
    for _ in range(4):
        a, at = torch.cat([a, v * a[-1]]), torch.cat([at, vt * at[-1]])
    assert_same(at, a, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    at.sum().backward()
    assert_same(wt.grad, w.grad, rtol=1e-5, atol=1e-5)
    assert_same(vt.grad, v.grad, rtol=1e-5, atol=1e-5)


def _counting(monkeypatch, module, name):
    """Counts the calls of module.name that return something."""
    calls, fn = [], getattr(module, name)

    def counted(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.extend([out] if out is not None else [])
        return out
    monkeypatch.setattr(module, name, counted)
    return calls


def test_appends_along_an_inner_dim_match_the_cpu(monkeypatch):
    # A dynamic KV cache: cat([past, new], dim=-2) from PyTorch's skipped empty 1-D tensor on.
    # Without a gradient the results have room to spare (growing_sequences.py): values,
    # strides, storage sizes and earlier results stay the CPU's, past the first capacity (64
    # positions).
    from torchtpu._core import metrics
    from torchtpu._execution import growing_sequences
    grown = _counting(monkeypatch, growing_sequences, "_inner_append")
    x = torch.tensor([])
    d = x.to("tpu")
    first = torch.randn(2, 3, 5, 4)
    x, d = torch.cat([x, first], dim=-2), torch.cat([d, first.to("tpu")], dim=-2)
    kept = []
    for step in range(70):
        new = torch.randn(2, 1, 3, 4).transpose(1, 2) if step % 3 else torch.randn(2, 3, 1, 4)
        x, d = torch.cat([x, new], dim=-2), torch.cat([d, new.to("tpu")], dim=-2)
        assert d.untyped_storage().nbytes() == x.untyped_storage().nbytes()
        if step == 2:
            before = metrics.build_counts.get("inner_append", 0)
        if step % 9 == 0:
            assert_same(d, x)
            kept.append((d, x.clone()))
    # past the first capacity: one program growing it, one for the appends at the new one,
    # whether the new rows are a transposed view or not
    assert metrics.build_counts.get("inner_append", 0) - before <= 2
    for got, want in kept:
        assert_same(got, want)
    d[1, 2, 3, 0] = -1  # writing into the result leaves what it was appended from alone
    assert_same(kept[-1][0], kept[-1][1])
    x[1, 2, 3, 0] = -1
    assert_same(d, x)
    assert len(grown) == 71
    # with a gradient to record, a plain cat: values and gradients stay the CPU's
    w = torch.randn(2, 3, 4, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    a, at = w * 1, wt * 1
    for _ in range(3):
        a, at = torch.cat([a, a[:, -1:] * 2], 1), torch.cat([at, at[:, -1:] * 2], 1)
    assert_same(at, a)
    a.sum().backward()
    at.sum().backward()
    assert_same(wt.grad, w.grad)
    assert len(grown) == 71


@pytest.mark.parametrize("heads, q_len, causal, dims, dtype", [
    (4, 1, False, 4, torch.float32), (2, 3, True, 4, torch.float32),
    (2, 2, False, 3, torch.float32), (4, 1, False, 4, torch.bfloat16)])
def test_attention_over_grown_keys_matches_the_cpu(heads, q_len, causal, dims, dtype, monkeypatch):
    # F.scaled_dot_product_attention over keys and values grown by appends reads them at
    # their capacity, masked past their length (growing_sequences.attention): a new length is
    # no new program.  Grouped-query (4 query heads over 2), a causal query of several
    # positions, and 3-d inputs against the CPU's attention, in float32 and bfloat16.
    import torch.nn.functional as F
    from torchtpu._core import metrics
    from torchtpu._execution import growing_sequences
    grown = _counting(monkeypatch, growing_sequences, "attention")
    lead = (2,) if dims == 4 else ()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    k, v = torch.randn(*lead, 2, 6, 8, dtype=dtype), torch.randn(*lead, 2, 6, 5, dtype=dtype)
    empty = torch.tensor([], dtype=dtype).to("tpu")
    kt, vt = torch.cat([empty, k.to("tpu")], -2), torch.cat([empty, v.to("tpu")], -2)
    with torch.no_grad():
        for step in range(12):
            q = torch.randn(*lead, heads, q_len, 8, dtype=dtype)
            gqa = heads != 2
            want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            got = F.scaled_dot_product_attention(q.to("tpu"), kt, vt, is_causal=causal, enable_gqa=gqa)
            assert_same(got, want, **tol)
            if step == 1:
                before = sum(metrics.build_counts.values())
            new_k = torch.randn(*lead, 2, 1, 8, dtype=dtype)
            new_v = torch.randn(*lead, 2, 1, 5, dtype=dtype)
            k, v = torch.cat([k, new_k], -2), torch.cat([v, new_v], -2)
            kt, vt = torch.cat([kt, new_k.to("tpu")], -2), torch.cat([vt, new_v.to("tpu")], -2)
    assert len(grown) == 12
    assert sum(metrics.build_counts.values()) == before  # lengths 8 to 17: nothing new
    # with a gradient to record, PyTorch's attention op and its formula
    q = torch.randn(*lead, heads, q_len, 8, dtype=dtype, requires_grad=True)
    qt = q.detach().to("tpu").requires_grad_()
    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != 2).sum().backward()
    F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=heads != 2).sum().backward()
    assert_same(qt.grad, q.grad, **(tol if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-5)))
    assert len(grown) == 12


def test_appends_of_the_last_token_reuse_their_executables():
    # A decode loop: append the next token, read it on the host (which runs fused eager's
    # trace, so each append starts from a written sequence, as generate()'s do).
    from torchtpu._core import metrics
    d = torch.arange(8).view(1, 8).to("tpu")
    for step in range(4):  # warm-up: the first appends and the first capacity
        d = torch.cat([d, d[:, -1:] + 1], dim=-1)
        assert d[0, -1].item() == 8 + step
    before = sum(metrics.build_counts.values())
    for step in range(40):
        d = torch.cat([d, d[:, -1:] + 1], dim=-1)
        assert d[0, -1].item() == 12 + step
    assert torch.equal(d.cpu(), torch.arange(52).view(1, 52))
    assert sum(metrics.build_counts.values()) - before == 0


def test_arange_bounds_keep_their_types_and_need_no_wait():
    # (static arguments 6 and 6.0 were one executable's key: arange(0, 6.0) came back int64
    # after an arange(0, 6); arange(end) went through a resized out= and waited for the device)
    torch.tpu.synchronize()
    before = counts("blocking_waits")[0]
    got = [torch.arange(*args, device="tpu") for args in
           ((0, 6, 1), (0, 6.0, 1), (6,), (6.0,), (True,), (2, 5), (2, 5.5))]
    assert counts("blocking_waits")[0] == before
    for g, args in zip(got, ((0, 6, 1), (0, 6.0, 1), (6,), (6.0,), (True,), (2, 5), (2, 5.5))):
        assert_same(g, torch.arange(*args))
