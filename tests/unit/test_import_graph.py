"""The package's import graph has no cycles (lazy, function-level imports included): a cycle means a helper lives in
the wrong module. Also: retrieval imports neither vLLM nor torch, and tooling is never imported by engine code."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# installed package name -> source folder (pyproject's package-dir)
ROOTS = {"vllm_treespec": REPO / "vllm_treespec", "vllm_treespec.proposers": REPO / "proposers",
         "vllm_treespec.retrieval": REPO / "retrieval"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def imported_names(module: str, path: Path) -> set[str]:
    is_package = path.name == "__init__.py"
    names = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            # the deepest of our modules that the name refers to
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_retrieval_imports_neither_vllm_nor_torch():
    for module, path in package_modules().items():
        if module.startswith("vllm_treespec.retrieval"):
            roots = {name.split(".")[0] for name in imported_names(module, path)}
            assert not roots & {"vllm", "torch"}, module


def test_engine_code_never_imports_tooling():
    tooling = ("vllm_treespec.tools", "vllm_treespec.training")
    for module, targets in import_graph().items():
        if not module.startswith(tooling):
            assert not [t for t in targets if t.startswith(tooling)], module


def test_the_plugin_and_the_public_api_import_no_numba():
    """Where the plugin is off (an unsupported vLLM) its numba-sensitive patch of vLLM's Triton kernel scan is not
    applied, and numba imported in the process then stops vLLM's CPU worker from starting: the entry point and the
    public API must load without it (in a fresh interpreter)."""
    import subprocess
    import sys

    code = "import sys, vllm_treespec.plugin, vllm_treespec.api; print(sorted({'numba', 'llvmlite'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
