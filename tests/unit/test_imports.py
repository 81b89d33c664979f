"""The house rules of recckpt's imports, read from the source with ast (nothing is imported):

1. no module imports or touches a private name (leading underscore, not a dunder) that another
   recckpt module defines: `from .x import _y`, or `obj._y` where `_y` is defined in some other
   module and not in this one (attribute access on objects of other modules, as far as a name-level
   scan can tell);
2. no import cycle among recckpt's modules, counting imports inside functions too;
3. every layer imports only the layers below it (docs: /work/shared/DESIGN.md "Layers").
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "recckpt")

#: Private names every module may use: the engine extension is the package's name for a layer.
ALLOWED_PRIVATE = {"_C"}

#: (module, name) pairs that still break rule 1, each with the reason it may, until fixed. Empty since
#: issue 13 item 1 gave Saver a public registry and write entry. Entries must match exactly: a fixed
#: one fails the test until it is removed here, a new one fails it until it is fixed or listed.
PENDING: frozenset[tuple[str, str]] = frozenset()

#: Import cycles that still exist (sorted module lists), on the same terms as PENDING.
PENDING_CYCLES: list[list[str]] = []

#: Layer of each top-level part of the package, and the layers each may import (its own included).
#: The layer table of /work/shared/DESIGN.md, top to bottom: integrations, cli, train, load, tools,
#: state, format, engine, storage, coordination. `api` is the compatibility alias of the old paths: it
#: names its targets as strings and imports nothing of recckpt's directly.
LAYER_OF = {"integrations": "integrations", "cli": "cli", "__main__": "cli", "train": "train", "load": "load",
            "tools": "tools", "api": "compat", "routing": "routing", "state": "state", "format": "format",
            "storage": "storage", "coordination": "coordination", "_C": "engine",
            "errors": "base", "_version": "base", "": "base"}
_BELOW_TOOLS = {"routing", "state", "format", "storage", "coordination", "engine", "base"}
MAY_IMPORT = {
    "integrations": {"train", "load", "tools"} | _BELOW_TOOLS,
    "cli": {"tools"} | _BELOW_TOOLS,
    # The training side may use the loading layer (Saver.load delegates to it), never the offline tools.
    "train": {"load"} | _BELOW_TOOLS,
    # Loading and the offline tools are siblings: neither imports the other, nor the training side.
    "load": _BELOW_TOOLS,
    "tools": _BELOW_TOOLS,
    "compat": set(),
    "routing": {"format", "engine", "base"},
    "state": {"engine", "base"},
    "format": {"storage", "engine", "base"},
    "coordination": {"storage", "engine", "base"},
    "storage": {"engine", "base"},
    "engine": set(),
    "base": {"base"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> dict[str, tuple[str, ast.Module]]:
    """module name -> (path, tree) for every recckpt/**.py."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            with open(path, encoding="utf-8") as fh:
                out[name] = (path, ast.parse(fh.read(), path))
    return out


MODULES = _modules()
KNOWN = set(MODULES) | {"recckpt._C"}


def _is_package(mod: str) -> bool:
    return MODULES[mod][0].endswith("__init__.py") if mod in MODULES else False


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not _is_package(mod):
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str, tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(target module, [names imported from it], line) for every import, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((_resolve(mod, node), [a.name for a in node.names], node.lineno))
    return out


def _edges(mod: str, tree: ast.Module) -> set[str]:
    """recckpt modules `mod` imports: `from pkg import sub` counts as the submodule, `from pkg import
    name` as the package itself."""
    out = set()
    for target, names, _ in _imports(mod, tree):
        if not target.startswith("recckpt"):
            continue
        if not names:
            out.add(target)
        for n in names:
            out.add(f"{target}.{n}" if f"{target}.{n}" in KNOWN else target)
    out.discard(mod)
    return {t for t in out if t in KNOWN}


def _defined(tree: ast.Module) -> set[str]:
    """Names a module defines: assigned names and attributes, functions, classes, arguments."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def private_name_violations() -> set[tuple[str, str]]:
    defined = {mod: _defined(tree) for mod, (_, tree) in MODULES.items()}
    defined_by = defaultdict(set)
    for mod, names in defined.items():
        for n in names:
            defined_by[n].add(mod)
    found = set()
    for mod, (_, tree) in MODULES.items():
        for target, names, _ in _imports(mod, tree):
            if target.startswith("recckpt"):
                found |= {(mod, n) for n in names if _private(n) and n not in ALLOWED_PRIVATE}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ALLOWED_PRIVATE:
                if node.attr not in defined[mod] and defined_by[node.attr] - {mod}:
                    found.add((mod, node.attr))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return LAYER_OF[parts[1] if len(parts) > 1 else ""]


# ------------------------------------------------------------------------------------------ tests
def test_no_module_touches_another_modules_private_names():
    found = private_name_violations()
    new = sorted(found - PENDING)
    assert not new, f"private names of other modules used (make them public, or add a public entry): {new}"
    fixed = sorted(PENDING - found)
    assert not fixed, f"fixed: remove these from PENDING in tests/unit/test_imports.py: {fixed}"


def test_the_private_name_scan_catches_what_it_should():
    """The scan itself: an import of another module's private name and an attribute access both count,
    a module's own private names and dunders do not."""
    saved = dict(MODULES)
    try:
        MODULES["recckpt.format._probe_a"] = ("a.py", ast.parse("_secret = 1\nclass A:\n    def _m(self): ...\n"))
        MODULES["recckpt.format._probe_b"] = ("b.py", ast.parse(
            "from ._probe_a import _secret\n"
            "def f(a):\n    a._m()\n    a.__dict__\n    return _own\n_own = 2\n"))
        found = private_name_violations()
    finally:
        MODULES.clear()
        MODULES.update(saved)
    probe = {p for p in found if p[0].startswith("recckpt.format._probe")}
    assert probe == {("recckpt.format._probe_b", "_secret"), ("recckpt.format._probe_b", "_m")}


def test_no_import_cycles():
    graph = {mod: _edges(mod, tree) for mod, (_, tree) in MODULES.items()}
    cycles = _cycles(graph)
    assert [c for c in cycles if c not in PENDING_CYCLES] == []
    assert [c for c in PENDING_CYCLES if c not in cycles] == [], "fixed: remove it from PENDING_CYCLES"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_only_layers_below():
    bad = []
    for mod, (_, tree) in sorted(MODULES.items()):
        layer = _layer(mod)
        for target in sorted(_edges(mod, tree)):
            if _layer(target) != layer and _layer(target) not in MAY_IMPORT[layer]:
                bad.append(f"{mod} ({layer}) imports {target} ({_layer(target)})")
    assert bad == []


def test_the_layer_check_catches_what_it_should():
    """The layer scan itself: a tool importing the training side, or the training side importing a tool,
    is reported; the training side importing the loading layer is not."""
    saved = dict(MODULES)
    try:
        MODULES["recckpt.tools._probe"] = ("t.py", ast.parse("from ..train import saver\n"))
        MODULES["recckpt.train._probe"] = ("s.py", ast.parse("from ..tools import reader\nfrom ..load import load_apply\n"))
        KNOWN.update({"recckpt.tools._probe", "recckpt.train._probe"})
        bad = [(m, t) for m in ("recckpt.tools._probe", "recckpt.train._probe")
               for t in sorted(_edges(m, MODULES[m][1])) if _layer(t) not in MAY_IMPORT[_layer(m)] | {_layer(m)}]
    finally:
        MODULES.clear()
        MODULES.update(saved)
        KNOWN.difference_update({"recckpt.tools._probe", "recckpt.train._probe"})
    assert bad == [("recckpt.tools._probe", "recckpt.train.saver"), ("recckpt.train._probe", "recckpt.tools.reader")]


def test_every_part_of_the_package_has_a_layer():
    parts = {m.split(".")[1] if "." in m else "" for m in KNOWN}
    assert parts - set(LAYER_OF) == set()


#: The one module outside recckpt/integrations that may name an integration: the plugin registry, which
#: imports an adapter by its path only when the adapted library is already loaded (DESIGN.md, "Layers").
INTEGRATION_REGISTRY = "recckpt.state.plugins"


def _names_integration(tree: ast.Module, mod: str) -> bool:
    for target, _, _ in _imports(mod, tree):
        if target.startswith("recckpt.integrations"):
            return True
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "recckpt.integrations" in n.value
               for n in ast.walk(tree))


def test_only_the_plugin_registry_names_an_integration():
    named = sorted(mod for mod, (_, tree) in MODULES.items()
                   if not mod.startswith("recckpt.integrations") and _names_integration(tree, mod))
    assert named == [INTEGRATION_REGISTRY]
    probe = ast.parse("import importlib\nimportlib.import_module('recckpt.integrations.torchrec')\n")
    assert _names_integration(probe, "recckpt.tools._probe")
