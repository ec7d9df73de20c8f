"""Every patch of a PyTorch or JAX global is listed in torchtpu/_frontend/patches.py, with the
function that applies it: checked in the source (an assignment to a torch/jax global only in a
listed function) and at run time (what `import torchtpu`, a first device use and a first
compilation change in torch, jax and accelerate, against the list)."""
import ast
import inspect
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import torch

import torchtpu
from torchtpu._frontend import current, patches

ROOT = pathlib.Path(torchtpu.__file__).parent
SOURCES = sorted(ROOT.rglob("*.py")) + [ROOT.parent / "torchtpu_autoload.py"]


# --- in the source -----------------------------------------------------------------------------
def _assigned_globals(source):
    """(dotted target, enclosing top-level function or None) of each assignment to an attribute
    of an object imported from torch or jax, `setattr` on one, or `jax.config.update` (the
    device module torch.tpu, torchtpu's own, excepted)."""
    tree = ast.parse(source)
    roots = {"torch", "jax"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in roots:
            roots |= {a.asname or a.name for a in node.names}
    found = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and function is None:
            function = node.name
        names = []
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute)]
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func == "setattr" and len(node.args) >= 2:
                names = [f"{ast.unparse(node.args[0])}.{ast.unparse(node.args[1])}"]
            elif func == "jax.config.update" and node.args:
                names = [f"jax.config.{ast.unparse(node.args[0])}"]
        for name in names:
            if name.split(".")[0] in roots and name != "torch.tpu" \
                    and not name.startswith("torch.tpu."):
                found.append((name, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def _appliers():
    """(file, function name) of every patch's apply."""
    found = set()
    for p in patches.PATCHES:
        fn = inspect.unwrap(p.apply)
        found.add((pathlib.Path(fn.__code__.co_filename).resolve(), fn.__name__))
    return found


def test_globals_are_assigned_only_by_the_listed_functions():
    appliers = _appliers()
    stray = []
    for path in SOURCES:
        for name, function in _assigned_globals(path.read_text()):
            if (path.resolve(), function) not in appliers:
                stray.append(f"{path.relative_to(ROOT.parent)}: {name} in {function or 'module'}")
    assert not stray, "list these in torchtpu/_frontend/patches.py:\n" + "\n".join(stray)


def test_the_source_check_sees_a_patch():
    src = textwrap.dedent("""
        import torch, jax
        from torch import nn
        torch.Tensor.add = f
        def g():
            nn.Module.x = 1
            setattr(torch.Tensor, "y", 2)
            jax.config.update("jax_enable_x64", True)
            torch.tpu.y = 2
    """)
    assert _assigned_globals(src) == [
        ("torch.Tensor.add", None), ("nn.Module.x", "g"), ("torch.Tensor.'y'", "g"),
        ("jax.config.'jax_enable_x64'", "g")]


# --- at run time -------------------------------------------------------------------------------
# In a fresh process: a snapshot of torch's, jax's and accelerate's modules and classes (and
# sys.meta_path, jax's and torch's config values), `import torchtpu`, a first device use (ops, a
# backward pass, an optimizer step) and a first compilation, another snapshot.  A change is an
# attribute whose value becomes torchtpu's code, a container that gains torchtpu's code (or a
# path into its source), or a changed config value.  Printed as JSON: the changes, and the
# (owner, attribute) each listed target resolves to.
_SNAPSHOT = r"""
import functools, importlib.util, inspect, json, os, sys, types, warnings
warnings.simplefilter("ignore")  # reading every attribute touches deprecated ones
import torch, jax
for name in sys.argv[1:]:  # modules imported before torchtpu
    __import__(name)
OURS = (os.path.dirname(importlib.util.find_spec("torchtpu").origin),
        importlib.util.find_spec("torchtpu_autoload").origin)
ROOTS = ("torch", "jax", "jaxlib", "accelerate")


def ours(v):
    if isinstance(v, str):
        return v.startswith(OURS)
    if isinstance(v, property):
        v = v.fget
    elif isinstance(v, (types.MethodType, classmethod, staticmethod)):
        v = v.__func__
    elif isinstance(v, functools.partial):
        v = v.func
    if isinstance(v, types.FunctionType):
        return v.__code__.co_filename.startswith(OURS)
    cls = v if isinstance(v, type) else type(v)
    return (cls.__module__ or "").split(".")[0] in ("torchtpu", "torchtpu_autoload")


def source(v):  # the file of torchtpu's code v is (a function or an instance), or None
    v = getattr(v, "func", v) if isinstance(v, functools.partial) else v
    if isinstance(v, types.FunctionType):
        return v.__code__.co_filename
    module = sys.modules.get(type(v).__module__)
    return None if isinstance(v, str) else getattr(module, "__file__", None)


def elements(v, depth=2):
    if isinstance(v, dict):
        found = list(v.keys()) + list(v.values())
    elif isinstance(v, (list, tuple, set, frozenset)):
        found = list(v)
    else:
        return []
    if depth > 1:
        found += [e for f in found if isinstance(f, tuple) for e in elements(f, depth - 1)]
    return found


def snapshot():
    found = {(id(sys), "meta_path"): ("sys.meta_path", sys.meta_path, set(map(id, sys.meta_path)))}
    for name, mod in list(sys.modules.items()):
        if (not isinstance(mod, types.ModuleType) or name.split(".")[0] not in ROOTS
                or name == "torch.tpu"):
            continue
        owners = [(name, mod)] + [(f"{name}.{k}", v) for k, v in list(vars(mod).items())
                                  if isinstance(v, type) and v.__module__ == name]
        for owner_name, owner in owners:
            for k, v in list(vars(owner).items()):
                if not isinstance(v, types.ModuleType):
                    found[(id(owner), k)] = (f"{owner_name}.{k}", v, {id(e) for e in elements(v)})
    return found


def configs():
    from torch.utils._config_module import ConfigModule
    found = {("jax.config", k): repr(h.value) for k, h in jax.config._value_holders.items()}
    for name, mod in list(sys.modules.items()):
        if isinstance(mod, ConfigModule):
            found.update(((name, k), repr(v)) for k, v in mod.get_config_copy().items())
    return found


def resolve(target):
    parts = target.split(".")
    if not all(p.isidentifier() for p in parts):
        return None  # a description, not an attribute
    if parts[:2] == ["jax", "config"]:
        return ["jax.config", parts[2]]
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            owner = sys.modules[module]
            for p in parts[i:-1]:
                owner = getattr(owner, p, None)  # None: a module not imported in this run
            return None if owner is None else [id(owner), parts[-1]]
    return None


before, configs_before = snapshot(), configs()
import torchtpu
from torchtpu._frontend import patches
x = torch.randn(4, device="tpu")
p = torch.nn.Parameter(torch.ones(3, device="tpu"))
opt = torch.optim.AdamW([p])
(p * x[:3]).sum().backward()
opt.step()
torch.compile(lambda a: a * 2, backend="tpu")(x).cpu()
after, configs_after = snapshot(), configs()
changed = []
owners = {owner for owner, _ in before}
for key, (name, value, ids) in after.items():
    old = before.get(key)
    if old is None and key[0] not in owners:
        continue  # an attribute of a module or class made since
    if old is None or old[1] is not value:
        if ours(value):  # replaced
            changed.append([list(key), name, []])
    elif added := [e for e in elements(value) if ours(e) and id(e) not in old[2]]:
        # What a container gained must come from the module of an entry's apply.
        changed.append([list(key), name, sorted({str(source(e)) for e in added} - {"None"})])
changed += [[list(k), ".".join(k), []] for k in configs_after
            if k in configs_before and configs_before[k] != configs_after[k]]
listed = [[resolve(t), inspect.unwrap(patch.apply).__code__.co_filename]
          for patch in patches.PATCHES for t in patch.targets]
print(json.dumps({"changed": changed, "listed": [t for t in listed if t[0] is not None]}))
"""

# Changes that are no patch of torchtpu's: PyTorch's own bookkeeping of what ran.
_NOT_PATCHES = {
    # Dynamo registers the "tpu" backend from this package's torch_dynamo_backends entry point
    # (pyproject.toml) when torch.compile looks it up.
    "torch._dynamo.backends.registry._COMPILER_FNS",
    # Dynamo's structured log interns the file names of the frames it traced.
    "torch._logging.structured.INTERN_TABLE",
}


def _unlisted(before_imports, code=_SNAPSHOT):
    """The changes the workload makes, and those no patch lists."""
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # torchtpu's import installs it
    r = subprocess.run([sys.executable, "-c", code, *before_imports], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    listed = {}  # (owner, attribute) -> the files of the applies listing it
    for target, applier in result["listed"]:
        listed.setdefault(tuple(target), set()).add(applier)
    unlisted = [name for key, name, sources in result["changed"] if name not in _NOT_PATCHES
                and (tuple(key) not in listed or not set(sources) <= listed[tuple(key)])]
    return {name for _, name, _ in result["changed"]}, sorted(unlisted)


def test_import_and_first_use_patch_only_what_is_listed():
    # The workload imports Dynamo (the optimizer, torch.compile) after the first snapshot: its
    # patches are checked below, where it is imported first.
    changed, unlisted = _unlisted([])
    assert not unlisted, "list these in torchtpu/_frontend/patches.py:\n" + "\n".join(unlisted)
    assert {"torch.compile", "torch.optim.optimizer._global_optimizer_pre_hooks",
            "sys.meta_path", "jax.config.jax_enable_x64"} <= changed, changed


def test_patches_of_modules_imported_before_torchtpu_are_listed():
    # Imported first, Dynamo's and accelerate's classes are patched in place: the accelerate
    # hook patches accelerate.state at once, the first compilation patches Dynamo.
    modules = ["torch._dynamo", "torch.distributed"]
    try:
        import accelerate.state  # noqa: F401
        modules.append("accelerate.state")
    except ImportError:
        pass
    changed, unlisted = _unlisted(modules)
    assert not unlisted, "list these in torchtpu/_frontend/patches.py:\n" + "\n".join(unlisted)
    assert "torch._dynamo.trace_rules.SKIP_DIRS" in changed, changed
    assert "torch._dynamo.variables.optimizer.OptimizerVariable._set_capturable" in changed
    if "accelerate.state" in modules:
        assert "accelerate.state.PartialState.default_device" in changed, changed


def test_the_run_time_check_sees_an_unlisted_patch():
    # Patches applied but left out of the list are named: a replaced attribute, a new one, and
    # a global hook from a module no entry's apply for that hook is in (fused.py's is a
    # post hook).
    patch = ("import torchtpu\ntorch.Tensor.unlisted = torch.nn.Module.cpu = torchtpu.export\n"
             "from torch.optim.optimizer import register_optimizer_step_pre_hook\n"
             "from torchtpu._execution import fused\n"
             "register_optimizer_step_pre_hook(fused._on_optimizer_step)\n")
    _, unlisted = _unlisted([], _SNAPSHOT.replace("import torchtpu\n", patch, 1))
    assert unlisted == ["torch.Tensor.unlisted", "torch.nn.modules.module.Module.cpu",
                        "torch.optim.optimizer._global_optimizer_pre_hooks"], unlisted


def test_every_patch_says_what_why_when_and_how():
    for p in patches.PATCHES:
        assert p.targets and p.why and p.when and p.checked_on and callable(p.apply), p


def test_import_time_patches_are_in_effect_once():
    assert torch.Tensor.to is current.tensor_to
    assert torch.accelerator.current_device_index is current.current_device_index
    assert torch.accelerator.set_device_idx is current.set_device_index
    from torch.optim import optimizer
    compile_, hooks = torch.compile, dict(optimizer._global_optimizer_pre_hooks)
    patches.install()  # a second install leaves the first patch, never a patch of a patch
    assert torch.compile is compile_ and torch.Tensor.to is current.tensor_to
    assert dict(optimizer._global_optimizer_pre_hooks) == hooks


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
