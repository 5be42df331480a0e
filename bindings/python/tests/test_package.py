"""The installed package: the native module's type stub names exactly what the module exports,
with the same parameters, and the stub and ``py.typed`` ship inside the package."""

import ast
import inspect
from pathlib import Path

import tessera
from tessera import _tessera

STUB = Path(tessera.__file__).with_name("_tessera.pyi")


def _stub_defs():
    tree = ast.parse(STUB.read_text())
    funcs, classes, names = {}, {}, set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            funcs[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    return funcs, classes, names


def test_stub_and_py_typed_ship_with_the_package():
    assert STUB.is_file()
    assert STUB.with_name("py.typed").is_file()


def test_stub_lists_every_native_export_and_nothing_else():
    funcs, classes, names = _stub_defs()
    public = {n for n in dir(_tessera) if not n.startswith("__") or n == "__version__"}
    exported_funcs = {n for n in public if inspect.isbuiltin(getattr(_tessera, n))}
    exported_classes = {n for n in public if inspect.isclass(getattr(_tessera, n))}
    exported_values = public - exported_funcs - exported_classes
    assert set(funcs) == exported_funcs
    assert set(classes) == exported_classes
    assert names == exported_values


def test_stub_signatures_match_the_native_ones():
    funcs, classes, _ = _stub_defs()
    for name, params in funcs.items():
        native = list(inspect.signature(getattr(_tessera, name)).parameters)
        assert params == native, name
    for cls, methods in classes.items():
        native = {n for n in dir(getattr(_tessera, cls)) if not n.startswith("__")}
        stubbed = {m for m in methods if not m.startswith("__")}
        assert stubbed == native, cls


def test_import_needs_numpy_only():
    # torch and jax made unimportable: masks, plans, packing and the text picture still work,
    # and importing tessera loads neither.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['jax'] = None\n"
        "import numpy as np, tessera\n"
        "ids = np.repeat(np.arange(4), 64)\n"
        "p = tessera.plan(tessera.causal() & tessera.document(ids), q_len=256, block=64)\n"
        "assert p.stats['allowed_pairs'] == 4 * 64 * 65 // 2, p.stats\n"
        "assert p.states().shape == (1, 1, 4, 4)\n"
        "assert tessera.pack([[1, 2, 3]], 8)['tokens'].shape == (1, 8)\n"
        "assert 'tessera.Plan' in repr(p)\n"
        "try:\n"
        "    import tessera.torch\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('tessera.torch imported without torch')\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
