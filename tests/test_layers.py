"""The layers of torch_spyre (docs/architecture.md): one direction of dependency.

Every import of the package, at module level or inside a function, goes from
a layer to a strictly lower one (or stays in its own package); the packages
import one another in no circle; and importing the layers below the runtime
registers nothing with PyTorch.
"""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "torch_spyre"

#: bottom to top; a package may import only packages of lower layers (the top
#: layer's entry points may also use each other)
LAYERS: list[set[str]] = [
    {"_version", "settings", "_card", "hardware", "dl16", "layout", "testing"},
    {"ir"},
    {"sim"},
    {"runtime"},
    {"distributed", "profiler"},
    {"kernels"},
    {"ops"},
    {"compiler"},
    {"models"},
    {"validation", "vllm_plugin", "tools", "cli", "compat", "_inductor", "model_utils", "__init__"},
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
#: native modules and the package they belong to (csrc/ is the runtime's)
PART_OF = {"_C": "runtime"}
#: inside the bottom layer, modules import each other in this order
BOTTOM = ["_version", "settings", "_card", "hardware", "dl16", "layout", "testing"]


def _unit(path: pathlib.Path) -> str:
    """The package (first-level directory or top module) a file belongs to."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: pathlib.Path):
    """(imported unit, line, inside a function) for every torch_spyre import."""
    tree = ast.parse(path.read_text())

    def visit(node, in_func):
        for ch in ast.iter_child_nodes(node):
            f = in_func or isinstance(ch, ast.FunctionDef | ast.AsyncFunctionDef)
            names = []
            if isinstance(ch, ast.ImportFrom) and ch.level == 0 and ch.module:
                if ch.module == "torch_spyre":
                    names = [f"torch_spyre.{a.name}" for a in ch.names]
                elif ch.module.startswith("torch_spyre."):
                    names = [ch.module]
            elif isinstance(ch, ast.Import):
                names = [a.name for a in ch.names if a.name.startswith("torch_spyre.")]
            for name in names:
                unit = name.split(".")[1]
                yield PART_OF.get(unit, unit), ch.lineno, f
            yield from visit(ch, f)

    yield from visit(tree, False)


def _edges():
    for path in sorted(PKG.rglob("*.py")):
        src = _unit(path)
        for dst, line, in_func in _imports(path):
            if dst != src:
                yield src, dst, f"{path.relative_to(ROOT)}:{line}", in_func


def test_every_package_has_a_layer():
    units = {_unit(p) for p in PKG.rglob("*.py")} | {"_card"}
    assert units - set(LAYER) == set(), "place new packages in LAYERS (and docs/architecture.md)"


def test_imports_go_down():
    wrong = []
    for src, dst, where, in_func in _edges():
        ls, ld = LAYER[src], LAYER[dst]
        if ls == 0 and ld == 0:
            if BOTTOM.index(dst) >= BOTTOM.index(src):
                wrong.append(f"{where}: {src} imports {dst} (bottom layer order {BOTTOM})")
        elif ld > ls or (ld == ls and ls != len(LAYERS) - 1):
            kind = "inside a function " if in_func else ""
            wrong.append(f"{where}: {src} (layer {ls}) imports {kind}{dst} (layer {ld})")
    assert wrong == []


def test_no_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in _edges():
        graph.setdefault(src, set()).add(dst)
    seen: dict[str, int] = {}

    def walk(node, stack):
        seen[node] = 1
        for nxt in graph.get(node, ()):
            if seen.get(nxt) == 1:
                raise AssertionError(" -> ".join([*stack, node, nxt]))
            if nxt not in seen:
                walk(nxt, [*stack, node])
        seen[node] = 2

    for node in list(graph):
        if node not in seen:
            walk(node, [])


#: every module of the layers below the runtime (and the kernel library)
LOWER = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for unit in ("settings", "hardware", "dl16", "layout", "ir", "sim", "kernels")
    for p in ([PKG / f"{unit}.py"] if (PKG / f"{unit}.py").exists() else (PKG / unit).rglob("*.py"))
)


def test_lower_layers_register_nothing():
    """Imported without the package's top (whose ``__init__`` registers the
    device), the IR, the simulated card and the kernel library leave PyTorch as
    they found it: no PrivateUse1 name, kernel or hook, no patched torch
    function, and the PyTorch integration (torch_spyre._C) not loaded."""
    code = textwrap.dedent(
        f"""
        import importlib, sys, types, torch
        before = {{n: getattr(torch.Tensor, n) for n in ("to", "cpu", "__repr__")}}
        before.update({{n: getattr(torch, n) for n in ("empty", "zeros", "randn", "tensor")}})
        pkg = types.ModuleType("torch_spyre")
        pkg.__path__ = [{str(PKG)!r}]
        sys.modules["torch_spyre"] = pkg  # the top's __init__ does not run
        for name in {LOWER!r}:
            importlib.import_module(name)
        assert torch._C._get_privateuse1_backend_name() == "privateuseone"
        for op in ("aten::add.Tensor", "aten::empty.memory_format", "aten::mm"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1"), op
        assert "torch_spyre._C" not in sys.modules
        after = {{n: getattr(torch.Tensor, n) for n in ("to", "cpu", "__repr__")}}
        after.update({{n: getattr(torch, n) for n in ("empty", "zeros", "randn", "tensor")}})
        assert after == before, [n for n in before if after[n] is not before[n]]
        print("ok", len({LOWER!r}))
        """
    )
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ok")


@pytest.mark.parametrize("unit", ["ops", "compiler"])
def test_producers_register_kernels_only_when_asked(unit):
    """The eager-op and compiler modules declare; ``torch_spyre/__init__``
    registers (``ops.register()``, ``compiler.install()``)."""
    code = textwrap.dedent(
        f"""
        import importlib, pathlib, sys, types, torch
        pkg = types.ModuleType("torch_spyre")
        pkg.__path__ = [{str(PKG)!r}]
        sys.modules["torch_spyre"] = pkg
        for p in sorted(pathlib.Path({str(PKG / unit)!r}).rglob("*.py")):
            rel = p.relative_to({str(ROOT)!r}).with_suffix("")
            importlib.import_module(".".join(rel.parts).removesuffix(".__init__"))
        for op in ("aten::mm", "aten::add.out", "aten::scaled_dot_product_attention"):
            for key in ("PrivateUse1", "AutogradPrivateUse1"):
                assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)
        print("ok")
        """
    )
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]


def test_docs_table_is_the_layers():
    """docs/architecture.md's table lists the packages of each layer, as here."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = re.search(r"<!-- layers table.*?-->\n(.*?)<!-- end of layers table -->", doc, re.S)
    assert table is not None
    rows = [r for r in table.group(1).splitlines() if re.match(r"\| \d+ \|", r)]
    got = {int(r.split("|")[1]): set(re.findall(r"`([\w]+)`", r.split("|")[2])) for r in rows}
    assert got == dict(enumerate(LAYERS))
