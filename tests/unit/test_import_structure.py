"""The import structure of the product (backend, builder, frontend, supervisor), the
clients and the benchmarks: no import circle between files, and the layers import downwards only. Every
import counts, those inside functions too (they run); imports under `if TYPE_CHECKING:`
do not (they never run). A failure names the circle or the import that breaks a rule."""

import ast
import os
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("backend", "builder", "clients", "frontend", "supervisor", "benchmarks")

# (folder, folders it must not import): the engine is above the models, the models above
# the kernels; Triton's adapter sits above the engine, the tools users run (clients/:
# the launcher, command-line clients, checks) above the product, and the benchmarks and
# device scripts (benchmarks/) above everything: no product code or client needs them.
LAYERS = [
    ("backend.ops", ("backend.models", "backend.engine", "backend.parallel", "backend.lora",
                     "backend.triton_server", "backend.attention")),
    ("backend.attention", ("backend.models", "backend.engine", "backend.parallel", "backend.lora",
                           "backend.triton_server")),
    ("backend.models", ("backend.engine", "backend.triton_server", "backend.dynamo_worker")),
    ("backend.engine", ("backend.triton_server", "backend.dynamo_worker")),
    # Two front doors to one engine: Dynamo's worker reads Triton's model entries, not the reverse.
    ("backend.triton_server", ("backend.dynamo_worker",)),
    ("backend", ("builder", "clients", "frontend", "supervisor", "benchmarks")),
    ("builder", ("clients", "frontend", "supervisor", "benchmarks")),
    ("frontend", ("clients", "benchmarks")),
    ("supervisor", ("clients", "benchmarks")),
    ("clients", ("benchmarks",)),
]


def modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    found[module.removesuffix(".__init__")] = path
    return found


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name imported from a package that is
    a module of its own counts as that module)."""
    def known(name: str) -> Optional[str]:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
                continue
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in mods else known(base))
        graph[module] = {t for t in targets if t and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _within(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    broken = []
    for folder, above in LAYERS:
        for module, targets in graph.items():
            if not _within(module, folder):
                continue
            inner = [f for f, _ in LAYERS if f != folder and _within(f, folder) and _within(module, f)]
            if inner:
                continue                    # a deeper folder's own rule applies
            broken += [f"{module} -> {t}" for t in sorted(targets) for up in above if _within(t, up)]
    return broken


def test_no_import_circle_between_files():
    found = circles(imports(modules()))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layers_import_downwards_only():
    broken = layer_breaks(imports(modules()))
    assert not broken, "imports against the layer order:\n" + "\n".join(broken)


def test_the_checks_see_a_circle_and_an_upward_import():
    graph = {"backend.ops.a": {"backend.models.b"}, "backend.models.b": {"backend.ops.a"}}
    assert circles(graph) == [["backend.models.b", "backend.ops.a"]]
    assert layer_breaks(graph) == ["backend.ops.a -> backend.models.b"]
