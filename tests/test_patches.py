"""Every patch of a PyTorch or JAX global is listed in torchtpu/_frontend/patches.py."""
import ast
import pathlib

import torch

import torchtpu
from torchtpu._frontend import current, patches

ROOT = pathlib.Path(torchtpu.__file__).parent


def _assigned_globals(source):
    """Dotted targets of assignments to attributes of objects imported from torch or jax
    (torch.tpu, torchtpu's own module, excepted)."""
    tree = ast.parse(source)
    roots = {"torch", "jax"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in roots:
            roots |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute):
                name = ast.unparse(t)
                if name.split(".")[0] in roots and not name.startswith("torch.tpu."):
                    found.append(name)
    return found


def test_no_global_is_patched_outside_the_patches_module():
    # The modules the table names as where a patch is applied ("_core/runtime.py, at import").
    allowed = {p.where.split(".")[0] for p in patches.PATCHES} | {"_frontend/patches"}
    stray = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.removesuffix(".py") in allowed:
            continue
        stray += [f"{rel}: {name}" for name in _assigned_globals(path.read_text())]
    assert not stray, "list these in torchtpu/_frontend/patches.py:\n" + "\n".join(stray)


def test_the_check_sees_a_patch():
    src = "import torch\nfrom torch import nn\ntorch.Tensor.add = f\nnn.Module.x = 1\ntorch.tpu.y = 2\n"
    assert _assigned_globals(src) == ["torch.Tensor.add", "nn.Module.x"]


def test_import_time_patches_are_in_effect_once():
    assert torch.Tensor.to is current.tensor_to
    assert torch.accelerator.current_device_index is current.current_device_index
    assert torch.accelerator.set_device_idx is current.set_device_index
    compile_ = torch.compile
    patches.install()  # a second install leaves the first patch, never a patch of a patch
    assert torch.compile is compile_ and torch.Tensor.to is current.tensor_to
    for p in patches.PATCHES:
        assert p.why and p.checked_on and p.where, p
