"""Every patch of a PyTorch or JAX global is listed in torchtpu/_frontend/patches.py."""
import ast
import pathlib
import subprocess
import sys
import textwrap

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


def test_ops_do_not_import_dynamo_until_it_is_used():
    # The meta kernels of tpu ops include PyTorch's Python references, wrapped by
    # torch._disable_dynamo, whose first call imported Dynamo (1.3-2.2 s).  A fresh process:
    # ops on tpu leave Dynamo unimported; after its import the wrappers disable it as before
    # (a compiled function over the same ops is right, and the wrapper holds Dynamo's disable).
    code = textwrap.dedent("""
        import sys
        import torch, torchtpu
        from torchtpu._frontend import patches
        x = torch.randn(5, device="tpu")
        y = int(x.cumsum(0).long().abs().max()) + torch.nn.functional.gelu(x).sum().item()
        assert "torch._dynamo" not in sys.modules
        shims = [f for f in patches.gc.get_objects() if type(f) is patches._UntilDynamoImported]
        assert shims
        import torch._dynamo
        f = torch.compile(lambda a: (a.cumsum(0) * 2).sum(), backend="tpu")
        assert f(torch.arange(5.0, device="tpu")).item() == 40.0
        x.cumsum(0).cpu()
        replaced = [s for s in shims if not isinstance(getattr(s.fn, "__dynamo_disable"),
                                                       patches._UntilDynamoImported)]
        assert replaced  # the ones called since hold Dynamo's own disabled function
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_an_optimizer_imports_dynamo_where_pytorch_does():
    # torch.optim's first step imports Dynamo in any case (`_use_grad`); stock PyTorch pays that
    # import when the optimizer is made (its `add_param_group` is wrapped by
    # torch._disable_dynamo), and so does an optimizer of tpu parameters: not the first step.
    code = textwrap.dedent("""
        import sys
        import torch, torchtpu
        p = torch.nn.Parameter(torch.ones(3, device="tpu"))
        assert "torch._dynamo" not in sys.modules
        opt = torch.optim.AdamW([p], lr=0.1)
        assert "torch._dynamo" in sys.modules
        p.sum().backward()
        opt.step()
        print(p.tolist())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    expected = torch.ones(3, requires_grad=True)
    opt = torch.optim.AdamW([expected], lr=0.1)
    expected.sum().backward()
    opt.step()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == str(expected.tolist()), (r.stdout, expected.tolist())
