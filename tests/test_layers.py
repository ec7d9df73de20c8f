"""The package floor plan: torchtpu's packages import only downward in one declared order, so
there is no cycle between them (function-level imports included: they must not hide one).
torchtpu_autoload.py, PyTorch's entry point outside the package, is the lowest layer: the
package builds on it, and it imports nothing of the package but the package itself, which it
loads at the first use of the device.  A look-up of a torchtpu module in sys.modules (or by
importlib.import_module) is an import too: it reaches the module as surely."""
import ast
import pathlib

import torchtpu

# Lowest first.  A module may import its own package and the packages before it.
LAYERS = ["torchtpu_autoload", "_core", "_lowerings", "_execution", "_compile", "_distributed",
          "_frontend", ""]
ROOT = pathlib.Path(torchtpu.__file__).parent
AUTOLOAD = ROOT.parent / "torchtpu_autoload.py"
# The one import against the order: the autoload loads the package (ensure_loaded), the
# purpose of its lazy half; it is no dependency of the autoload's code on the package's.
LOADS_THE_PACKAGE = ("torchtpu_autoload", "torchtpu")


def _layer(module):
    """The layer of a dotted torchtpu module name ("" for the top-level modules)."""
    if module == "torchtpu_autoload":
        return module
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else ""
    return sub if sub in LAYERS else ""


def _module_name(path):
    if path == AUTOLOAD:
        return "torchtpu_autoload", False
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts), parts[-1] == "__init__"


def _looked_up(node):
    """The module name a `sys.modules[...]`, `sys.modules.get(...)` or
    `importlib.import_module(...)` with a constant name reaches, or None."""
    def constant(n):
        return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        return constant(node.slice)
    if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in (
            "sys.modules.get", "importlib.import_module"):
        return constant(node.args[0])
    return None


def _imports_in(name, is_package, source, where):
    """(importing module, imported torchtpu module, line) for every import in `source`."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from pkg import mod` imports pkg.mod when that is a module.
            targets = [base] + [f"{base}.{a.name}" for a in node.names
                                if _is_module(f"{base}.{a.name}")]
        elif (looked_up := _looked_up(node)) is not None:
            targets = [looked_up]
        else:
            continue
        for t in targets:
            if t == "torchtpu" or t.startswith("torchtpu.") or t == "torchtpu_autoload":
                yield name, t, f"{where}:{node.lineno}"


def _imports():
    """(importing module, imported module, line) for every import in the package and the
    autoload, but the autoload's load of the package."""
    for path in sorted(ROOT.rglob("*.py")) + [AUTOLOAD]:
        name, is_package = _module_name(path)
        for src, dst, where in _imports_in(name, is_package, path.read_text(),
                                           str(path.relative_to(ROOT.parent))):
            if (src, dst) != LOADS_THE_PACKAGE:
                yield src, dst, where


def _is_module(dotted):
    p = ROOT.parent.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _upward(imports):
    return [f"{where}: {src} imports {dst}" for src, dst, where in imports
            if LAYERS.index(_layer(dst)) > LAYERS.index(_layer(src))]


def _cycle(imports):
    """A cycle among modules (every import counted, function-level ones too), or None."""
    graph = {}
    for src, dst, _ in imports:
        if dst != src and not src.startswith(dst + "."):  # a package's parents run first anyway
            graph.setdefault(src, set()).add(dst)
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_every_package_is_declared_in_the_layer_order():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"conformance", "examples"}
    assert packages <= set(LAYERS), f"add {sorted(packages - set(LAYERS))} to LAYERS"


def test_packages_import_only_downward():
    upward = _upward(_imports())
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_module_imports_itself_through_others():
    assert _cycle(list(_imports())) is None


def test_the_autoload_loads_the_package_and_imports_nothing_else_of_it():
    source = AUTOLOAD.read_text()
    found = {dst for _, dst, _ in _imports_in("torchtpu_autoload", False, source, "a.py")}
    assert found == {"torchtpu"}, found
    imports = {(s, d) for s, d, _ in _imports()}
    assert ("torchtpu._core.runtime", "torchtpu_autoload") in imports  # it is below _core


def test_the_checks_can_fail():
    """A core module importing the front door, and two modules importing each other, are caught."""
    imports = list(_imports())
    assert ("torchtpu._lowerings.conv", "torchtpu._core.registry") in {(s, d) for s, d, _ in imports}
    # A look-up in sys.modules, or an import of a package module by the autoload, is an import.
    src = ("import sys, importlib\nsys.modules.get('torchtpu')\n"
           "sys.modules['torchtpu._execution.fused']\nimportlib.import_module('torchtpu.pallas')\n"
           "sys.modules.get('torch._dynamo')\n")
    assert [d for _, d, _ in _imports_in("torchtpu._core.storage", False, src, "x.py")] == [
        "torchtpu", "torchtpu._execution.fused", "torchtpu.pallas"]
    reach = [("torchtpu_autoload", "torchtpu._core.runtime", "x.py:1")]
    assert _upward(reach) == ["x.py:1: torchtpu_autoload imports torchtpu._core.runtime"]
    bad = imports + [("torchtpu._core.storage", "torchtpu._execution.fused", "x.py:1")]
    assert _upward(bad) == ["x.py:1: torchtpu._core.storage imports torchtpu._execution.fused"]
    cycle = _cycle(imports + [("torchtpu._execution.modes", "torchtpu._execution.fused", "x.py:1")])
    assert cycle is not None and "torchtpu._execution.modes" in cycle
