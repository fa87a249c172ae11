"""The package layout issue 27 set: plugins import only the public backend API, no import cycle crosses packages,
no private name crosses packages, and contract v2's old import paths still work with one warning naming the new one."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import pytest

import pagedllm
from pagedllm import deprecated

ROOT = Path(pagedllm.__file__).parent
REPO = ROOT.parent.parent
PUBLIC_API = "pagedllm.backend"


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every absolute import in ``path`` outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_plugins_import_only_the_public_backend_api():
    bad = []
    for path in sorted((REPO / "plugins").rglob("*.py")):
        for module, _, line in _imports(path):
            if module.split(".")[0] == "pagedllm" and not (module == PUBLIC_API or module.startswith(PUBLIC_API + ".")):
                bad.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert not bad, "plugins may import only pagedllm.backend (and its submodules):\n" + "\n".join(bad)


def test_every_public_backend_name_resolves():
    import pagedllm.backend as api

    assert len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def _package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the import sites; a package is ``pagedllm.<first name>``."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, path in modules.items():
        for module, names, line in _imports(path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                if target in modules:
                    a, b = ".".join(name.split(".")[:2]), ".".join(target.split(".")[:2])
                    if a != b and "pagedllm" not in (a, b):
                        graph[a][b].append(f"{path.relative_to(ROOT.parent)}:{line} -> {target}")
    return graph


def test_no_import_cycle_crosses_packages():
    graph = _package_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    report = [f"{c}: " + "; ".join(site for a in c for b in c if b in graph.get(a, {}) for site in graph[a][b])
              for c in cycles]
    assert not cycles, "\n".join(report)


def test_no_private_name_is_imported_across_packages():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        here = ".".join(_module_name(path).split(".")[:2])
        for module, names, line in _imports(path):
            there = ".".join(module.split(".")[:2])
            if module.startswith("pagedllm") and there != here:
                bad += [f"{path.relative_to(ROOT.parent)}:{line}: {module}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


_OLD_PATHS_CHECK = """
import importlib, json, sys, warnings
import pagedllm
from pagedllm.deprecated import OLD_MODULES
bad = []
for old, new in sorted(OLD_MODULES.items()):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        importlib.import_module(old)  # imported once: no second warning
    mine = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning) and str(x.message).startswith(old + " ")]
    target = importlib.import_module(new)
    shared = [k for k in vars(target) if not k.startswith("_")]
    if len(mine) != 1 or new not in mine[0] or not all(getattr(module, k) is getattr(target, k) for k in shared):
        bad.append((old, mine))
print(json.dumps(bad))
"""


def test_old_module_paths_import_with_one_warning_naming_the_new():
    # A fresh interpreter, so no old path was imported before; the new module's names are the same objects.
    r = subprocess.run([sys.executable, "-c", _OLD_PATHS_CHECK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-2000:]


@pytest.mark.parametrize("old, new", [
    ("pagedllm.sampling_params.ParamError", "pagedllm.errors.ParamError"),
    ("pagedllm.worker.dummy_metadata", "pagedllm.worker.worker.dummy_metadata"),
    ("pagedllm.engine.EngineStats", "pagedllm.engine.llm_engine.EngineStats"),
])
def test_old_names_of_moved_objects_warn_once(old, new):
    module, _, name = old.rpartition(".")
    sys.modules.get(module) and vars(sys.modules[module]).pop(name, None)  # a moved name is cached after one lookup
    mod = importlib.import_module(module)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        obj = getattr(mod, name)
        getattr(mod, name)
    msgs = [str(x.message) for x in w if issubclass(x.category, DeprecationWarning)]
    assert len(msgs) == 1 and new in msgs[0], msgs
    new_module, _, new_name = new.rpartition(".")
    assert obj is getattr(importlib.import_module(new_module), new_name)
