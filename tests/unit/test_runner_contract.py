"""The vLLM runner attributes tree verification relies on: the lists in vllm_treespec/verify/verifier.py are exactly
what the code reads and writes (found by parsing it, so the lists cannot go stale), and the installed vLLM has each
of them (found by parsing its classes, so an upgrade that renames one fails here, not in an engine).

In the spirit of the patch-signature test in test_config_and_plugin.py. No engine; a few seconds.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

from vllm_treespec.verify.verifier import (BLOCK_TABLE_ATTRIBUTES, CONTRACT_MODULES, INPUT_BATCH_ATTRIBUTES,
                                           OWN_RUNNER_ATTRIBUTES, REQUEST_STATE_ATTRIBUTES, RUNNER_ATTRIBUTES)

REPO = Path(__file__).resolve().parents[2]
RUNNER, INPUT_BATCH, BLOCK_TABLES, BLOCK_TABLE, REQUESTS, REQUEST_STATE = (
    "runner", "input_batch", "block_tables", "block_table", "requests", "request_state")
TRACKED = (RUNNER, INPUT_BATCH, BLOCK_TABLE, REQUEST_STATE)
# names that stand for these objects wherever they appear in the contract modules
NAMED = {"runner": RUNNER, "input_batch": INPUT_BATCH, "requests": REQUESTS}


# --- what the code accesses -------------------------------------------------------------------------------------------

class AccessScanner:
    """Finds ``(kind, attribute)`` for every attribute of a runner, input batch, block table or request state that a
    module reads or writes: ``runner.X``, ``self.runner.X``, ``worker.model_runner.X``, ``self.X`` in the wrappers of
    GPUModelRunner methods, ``input_batch.X``, ``<input batch>.block_table[i].X``, ``<runner>.requests[r].X`` /
    ``.requests.get(r).X``, ``getattr / hasattr / setattr(<one of them>, "X")``, and the same through local names
    assigned from any of these. A computed attribute name is reported as ``"<dynamic>"``."""

    def __init__(self) -> None:
        self.found: set[tuple[str, str]] = set()

    def scan_module(self, source: str) -> set[tuple[str, str]]:
        tree = ast.parse(source)
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            self._scan_function(function)
        return self.found

    @staticmethod
    def _wraps_runner_method(function: ast.FunctionDef) -> bool:
        for decorator in function.decorator_list:
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "wrap_method" \
                    and decorator.args and getattr(decorator.args[0], "id", None) == "GPUModelRunner":
                return True
        return False

    def _scan_function(self, function: ast.FunctionDef) -> None:
        self_is_runner = self._wraps_runner_method(function)
        env: dict[str, str] = {}
        assigns = [n for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr))
                   and n.value is not None]
        changed = True
        while changed:  # local names, flow-insensitive, to a fixed point
            changed = False
            for node in assigns:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                kind = self._kind(node.value, env, self_is_runner)
                for target in targets:
                    if kind and isinstance(target, ast.Name) and env.get(target.id) != kind:
                        env[target.id] = kind
                        changed = True
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute):
                kind = self._kind(node.value, env, self_is_runner)
                if kind in TRACKED:
                    self.found.add((kind, node.attr))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr") \
                    and node.args:
                kind = self._kind(node.args[0], env, self_is_runner)
                if kind in TRACKED:
                    name = node.args[1] if len(node.args) > 1 else None
                    is_constant = isinstance(name, ast.Constant) and isinstance(name.value, str)
                    self.found.add((kind, name.value if is_constant else "<dynamic>"))

    def _kind(self, node: ast.AST, env: dict[str, str], self_is_runner: bool) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "self":
                return RUNNER if self_is_runner else None
            return env.get(node.id) or NAMED.get(node.id)
        if isinstance(node, ast.Attribute):
            if node.attr == "runner" and isinstance(node.value, ast.Name) and node.value.id == "self":
                return RUNNER
            if node.attr == "model_runner":
                return RUNNER
            owner = self._kind(node.value, env, self_is_runner)
            return {(RUNNER, "input_batch"): INPUT_BATCH, (RUNNER, "requests"): REQUESTS,
                    (INPUT_BATCH, "block_table"): BLOCK_TABLES}.get((owner, node.attr))
        if isinstance(node, ast.Subscript):
            return {BLOCK_TABLES: BLOCK_TABLE, REQUESTS: REQUEST_STATE}.get(self._kind(node.value, env, self_is_runner))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return REQUEST_STATE if self._kind(node.func.value, env, self_is_runner) == REQUESTS else None
        return None


def module_paths(name: str) -> list[Path]:
    """The source files of a module or of every module of a package (by the repository's layout)."""
    path = REPO.joinpath(*name.split("."))
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def accessed() -> set[tuple[str, str]]:
    scanner = AccessScanner()
    for module in CONTRACT_MODULES:
        paths = module_paths(module)
        assert paths and all(p.is_file() for p in paths), module
        for path in paths:
            scanner.scan_module(path.read_text())
    return scanner.found


LISTED = {RUNNER: set(RUNNER_ATTRIBUTES) | set(OWN_RUNNER_ATTRIBUTES), INPUT_BATCH: set(INPUT_BATCH_ATTRIBUTES),
          BLOCK_TABLE: set(BLOCK_TABLE_ATTRIBUTES), REQUEST_STATE: set(REQUEST_STATE_ATTRIBUTES)}


@pytest.mark.parametrize("kind", TRACKED)
def test_the_lists_are_exactly_what_the_code_accesses(kind):
    used = {attribute for k, attribute in accessed() if k == kind}
    where = "vllm_treespec/verify/verifier.py"
    assert sorted(used - LISTED[kind]) == [], f"{kind} attributes used but not listed in {where}"
    assert sorted(LISTED[kind] - used) == [], f"{kind} attributes listed but no longer used"


def test_scanner_sees_every_access_form():
    source = textwrap.dedent('''
        def build(runner, worker, key):
            runner.a1
            batch = runner.input_batch
            batch.b1
            input_batch.b2
            table = batch.block_table[0]
            table.c1.np
            runner.requests["r"].d1
            state = runner.requests.get("r")
            state.d2
            getattr(runner, "a2", None)
            hasattr(worker.model_runner, "a3")
            getattr(runner, key)
            other.x

        class Verifier:
            def step(self):
                self.runner.a4 = 1
                self.not_the_runner

        @wrap_method(GPUModelRunner, "m", ("self",))
        def m(original, self):
            self.a5
        ''')
    assert AccessScanner().scan_module(source) == {
        (RUNNER, "a1"), (RUNNER, "input_batch"), (INPUT_BATCH, "b1"), (INPUT_BATCH, "b2"), (INPUT_BATCH, "block_table"),
        (BLOCK_TABLE, "c1"), (RUNNER, "requests"), (REQUEST_STATE, "d1"), (REQUEST_STATE, "d2"), (RUNNER, "a2"),
        (RUNNER, "a3"), (RUNNER, "<dynamic>"), (RUNNER, "a4"), (RUNNER, "a5")}


# --- what the installed vLLM has --------------------------------------------------------------------------------------

def vllm_attributes(cls: type) -> set[str]:
    """Attributes instances of ``cls`` have in the installed vLLM: class attributes, methods and properties,
    class-level annotations (dataclass fields), and every ``self.X`` that a method of the class or of a vLLM base
    class assigns."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vllm."):
            continue
        names.update(vars(klass))
        names.update(getattr(klass, "__annotations__", {}))
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            else:
                continue
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    names.add(target.attr)
    return names


def vllm_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


CLASSES = {
    RUNNER: ("vllm.v1.worker.cpu_model_runner.CPUModelRunner", RUNNER_ATTRIBUTES),
    INPUT_BATCH: ("vllm.v1.worker.gpu_input_batch.InputBatch", INPUT_BATCH_ATTRIBUTES),
    BLOCK_TABLE: ("vllm.v1.worker.block_table.BlockTable", BLOCK_TABLE_ATTRIBUTES),
    REQUEST_STATE: ("vllm.v1.worker.gpu_input_batch.CachedRequestState", REQUEST_STATE_ATTRIBUTES),
}


@pytest.mark.parametrize("kind", TRACKED)
def test_installed_vllm_has_every_listed_attribute(kind):
    path, listed = CLASSES[kind]
    cls = vllm_class(path)
    missing = sorted(set(listed) - vllm_attributes(cls))
    assert missing == [], f"{path} (vLLM {importlib.import_module('vllm').__version__}) lacks {missing}"


def test_the_runner_is_the_gpu_runner_the_patch_wraps_and_our_attribute_is_ours():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_cls = vllm_class(CLASSES[RUNNER][0])
    assert issubclass(runner_cls, GPUModelRunner)
    assert set(OWN_RUNNER_ATTRIBUTES) & vllm_attributes(runner_cls) == set()
    # the input batch and block table the runner builds are the classes checked above
    runner_source = inspect.getsource(GPUModelRunner.__init__)
    assert "self.input_batch = InputBatch(" in runner_source
    assert vllm_class(CLASSES[INPUT_BATCH][0]) is importlib.import_module(GPUModelRunner.__module__).InputBatch


def test_the_fake_runner_has_only_listed_attributes():
    """tests/helpers/fake_runner.py stands in for the runner in test_verifier.py; it may not invent attributes."""
    from fake_runner import FakeRequest, fake_runner

    runner = fake_runner([FakeRequest("a", [1, 2], [0])])
    assert set(vars(runner)) <= set(RUNNER_ATTRIBUTES)
    assert set(vars(runner.input_batch)) <= set(INPUT_BATCH_ATTRIBUTES)
    assert set(vars(runner.input_batch.block_table[0])) <= set(BLOCK_TABLE_ATTRIBUTES)
    assert set(vars(runner.requests["a"])) <= set(REQUEST_STATE_ATTRIBUTES)
