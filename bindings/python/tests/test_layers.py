"""The Python package's architecture, checked from its source (no import of the package needed).

Layers, low to high (docs/ARCHITECTURE.md, "Python package"):
  core      ``tessera/core/``      masks, plans, shardings, telemetry config, argument checks,
                                   the plan exporters (BlockMask, MaskInfo)
  engines   ``tessera/engines/``   one module per engine (and the transport they share)
  frontends ``tessera/torch/``, ``tessera/jax/``, ``tessera/cp.py``
  facade    ``tessera/__init__.py``, ``tessera/layouts.py`` (public names only)

An import edge is every ``import``/``from ... import`` of a ``tessera`` module anywhere in a file
(module level or inside a function: a lazy import is still a dependency), resolved to the module
it names (``from .pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``; imports under ``if TYPE_CHECKING:`` never run and are not edges); the native module ``tessera._tessera`` sits below every layer. The parents a Python import runs implicitly are not edges. The rules: no edge runs to a
higher layer; the module graph has no cycle; no file is over 600 lines.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

PKG = pathlib.Path(__file__).resolve().parents[1] / "python" / "tessera"
LAYERS = {"core": 0, "engines": 1, "frontends": 2, "facade": 3}
NATIVE = "tessera._tessera"  # the compiled module: below every layer, imports nothing of ours


def _modules() -> Dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] == "layouts":
        return "facade"
    if parts[1] == "core":
        return "core"
    if parts[1] == "engines":
        return "engines"
    assert parts[1] in ("torch", "jax", "cp"), f"{mod}: a module outside the documented layers"
    return "frontends"


def _is_type_checking(node: ast.AST) -> bool:
    """An ``if TYPE_CHECKING:`` block: imports for annotations only, never run."""
    return isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"


def _edges(mod: str, path: pathlib.Path, mods: Dict[str, pathlib.Path]) -> Set[str]:
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out: Set[str] = set()

    def add(target: str) -> None:
        if target in mods and target != mod:
            out.add(target)
        else:  # only the native module (below every layer) or a name of the package itself
            assert target in mods or target == NATIVE, f"{mod}: import of unknown module {target}"

    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for n in ast.walk(tree) if _is_type_checking(n) for n in ast.walk(n)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "tessera" or a.name.startswith("tessera."):
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            elif node.module and (node.module == "tessera" or node.module.startswith("tessera.")):
                target = node.module
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                add(sub if sub in mods or sub == NATIVE else target)
    return out


def _graph() -> Dict[str, Set[str]]:
    mods = _modules()
    return {m: _edges(m, p, mods) for m, p in mods.items()}


def _cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """A cycle of ``graph`` as a path (first node repeated at the end), or ``[]``."""
    state: Dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return []


def test_the_layers_are_the_documented_ones():
    mods = _modules()
    layers = {_layer(m) for m in mods}
    assert layers == set(LAYERS)
    assert {"tessera.core.plans", "tessera.engines.flex", "tessera.engines.native_xla",
            "tessera.engines.splash", "tessera.engines.native_torch", "tessera.torch",
            "tessera.jax", "tessera.cp"} <= set(mods)


def test_no_import_runs_upward():
    bad = [
        f"{m} ({_layer(m)}) imports {t} ({_layer(t)})"
        for m, targets in _graph().items()
        for t in sorted(targets)
        if LAYERS[_layer(t)] > LAYERS[_layer(m)]
    ]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_what_it_looks_for():
    # The two checks on a made-up graph: a cycle is found, and an engine importing a frontend is
    # classed upward.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
    assert LAYERS[_layer("tessera.torch.op")] > LAYERS[_layer("tessera.engines.flex")]
    assert LAYERS[_layer("tessera.engines.flex")] > LAYERS[_layer("tessera.core.plans")]


def test_no_file_is_over_600_lines():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"files over 600 lines: {long}"
