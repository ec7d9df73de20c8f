"""The lowering table names only ops that exist: `registry.lowering` skips a name this torch
release lacks (registry.ABSENT collects it), so a typo would leave its op silently unlowered.
Here a name this release lacks fails, unless a supported release (2.11-2.15) lacks it for a
reason listed below."""
import torch
from torch.torch_version import TorchVersion

import torchtpu  # noqa: F401  (fills the lowering table)
from torchtpu._core import registry

# Ops some supported torch releases lack: name -> (does this release have it?, why not always).
VERSION_DEPENDENT = {
    "aten::cholesky.default": (lambda v: v < (2, 14),
                               "torch.cholesky's op, removed in torch 2.14 (docs/compatibility.md)"),
}


def test_every_name_in_the_lowering_table_is_an_op_of_this_release():
    version = TorchVersion(torch.__version__)
    lacking = {name for name, (has, _) in VERSION_DEPENDENT.items() if not has(version)}
    unknown = sorted(set(registry.ABSENT) - lacking)
    assert not unknown, (f"lowerings of ops torch {torch.__version__} does not have: {unknown} "
                         "(a typo, or an op a supported release lacks: list it in "
                         "VERSION_DEPENDENT with why)")
    # A listed op this release has after all is lowered: the list says when it exists.
    assert sorted(registry.ABSENT) == sorted(lacking)
    for name in set(VERSION_DEPENDENT) - lacking:
        assert registry.overload_of(name) in registry.TABLE, name


def test_a_name_no_release_has_is_collected_not_registered(monkeypatch):
    # What the test above reads: an unknown name lands in ABSENT and nowhere in the table.
    monkeypatch.setattr(registry, "ABSENT", [])
    before = dict(registry.TABLE)
    registry.lowering("aten::no_such_op.default", "aten::relu.no_such_overload")(lambda x: x)
    assert registry.ABSENT == ["aten::no_such_op.default", "aten::relu.no_such_overload"]
    assert registry.TABLE == before
