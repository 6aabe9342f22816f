"""Import layers of mlx_h2o, read from the source with ast (nothing is imported).

Module-level imports (those that run when a module loads: its body, if / try
blocks and class bodies) must form no cycle. A function may import lazily
(kernels/quantized.py reaches its GPU module when one runs), except where a
layer must never reach another at all: kernels (a stack of their own over
mlx and the score registry), policy / scores, profiles.
``importlib.import_module`` calls (the package's lazy public names, the CLI's
commands) are not imports here.
"""

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "mlx_h2o"
# The leaf module the kernels may build on: the score registry (kernel ids,
# stdlib only).
BELOW_KERNELS = ("mlx_h2o.scores",)
KERNEL_DEPS = ("mlx", "numpy")  # besides the standard library


def _modules():
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _base(name: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    pkg = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(pkg + ([node.module] if node.module else []))


def imports(name: str, lazy: bool):
    """[(target, line)] of module ``name``: an mlx_h2o target is the module it
    loads (``from . import x`` -> the submodule x), others their dotted name.
    ``lazy`` adds the imports inside functions."""
    path = MODULES[name]
    is_pkg, out = path.name == "__init__.py", []

    def visit(nodes):
        for node in nodes:
            if not lazy and isinstance(node, FUNCTIONS):
                continue
            if isinstance(node, ast.Import):
                out.extend((a.name, node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _base(name, is_pkg, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub if sub in MODULES else base, node.lineno))
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text(), str(path)).body)
    return [(_owner(t), line) for t, line in out]


def _owner(target: str) -> str:
    """The mlx_h2o module a dotted target lives in (``a.b.C``: ``a.b``), else itself."""
    t = target
    while t not in MODULES and "." in t:
        t = t.rpartition(".")[0]
    return t if t in MODULES else target


def graph(lazy: bool, within: str = "mlx_h2o"):
    return {m: {t for t, _ in imports(m, lazy) if _under(t, within) and t != m}
            for m in MODULES if _under(m, within)}


def _under(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def find_cycle(g):
    """One cycle of ``g`` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def dfs(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := dfs(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(g):
        if v not in state and (found := dfs(v)):
            return found
    return None


def violations(modules_in: str, lazy: bool, bad) -> list:
    return [f"{m}:{line} imports {t}" for m in MODULES if _under(m, modules_in)
            for t, line in imports(m, lazy) if bad(t)]


def test_the_parser_sees_module_level_and_lazy_imports():
    assert "mlx_h2o.kernels.build" in graph(False)["mlx_h2o.kernels.decode"]
    assert "mlx_h2o.cache.h2o" in graph(False)["mlx_h2o.cache"]  # from .h2o import ...
    gpu = "mlx_h2o.kernels.quantized_gpu"
    assert gpu in graph(True)["mlx_h2o.kernels.quantized"]  # imported when a GPU runs
    assert gpu not in graph(False)["mlx_h2o.kernels.quantized"]


def test_the_caches_import_nothing_inside_functions():
    """cache/ is a stack at module level: no import circle held apart by an
    import inside a function (saving and loading live above it)."""
    lazy = {m: deps - graph(False).get(m, set()) for m, deps in graph(True).items()
            if _under(m, "mlx_h2o.cache")}
    assert {m: d for m, d in lazy.items() if d} == {}


def test_no_import_cycle_at_module_level():
    cycle = find_cycle(graph(lazy=False))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_are_a_stack_even_with_lazy_imports():
    cycle = find_cycle(graph(lazy=True, within="mlx_h2o.kernels"))
    assert cycle is None, "kernels import cycle: " + " -> ".join(cycle)


def test_kernels_import_mlx_and_lower_kernels_only():
    def bad(t):
        if _under(t, "mlx_h2o"):
            allowed = ("mlx_h2o.kernels",) + BELOW_KERNELS
            return not any(_under(t, a) for a in allowed)
        top = t.partition(".")[0]
        return top not in sys.stdlib_module_names and top not in KERNEL_DEPS

    assert violations("mlx_h2o.kernels", True, bad) == []


def test_what_the_kernels_build_on_is_a_leaf():
    for leaf in BELOW_KERNELS:
        def bad(t, leaf=leaf):
            return _under(t, "mlx_h2o") and not _under(t, leaf)

        assert violations(leaf, True, bad) == []
    # scores: stdlib only (config reads it, and `mlx-h2o --help` loads no MLX).
    stdlib = sys.stdlib_module_names
    assert violations("mlx_h2o.scores", True,
                      lambda t: t.partition(".")[0] not in stdlib) == []


def _reaches(*layers):
    return lambda t: any(_under(t, layer) for layer in layers)


def test_policy_and_scores_stay_below_caches_and_tools():
    upper = ("cache", "integration", "eval", "cli")
    bad = _reaches(*(f"mlx_h2o.{layer}" for layer in upper))
    for low in ("mlx_h2o.policy", "mlx_h2o.scores"):
        assert violations(low, True, bad) == []


def test_profiles_never_import_eval():
    assert violations("mlx_h2o.profiles", True, _reaches("mlx_h2o.eval")) == []


def test_caches_do_not_import_integration_cli_or_eval_at_module_level():
    bad = _reaches("mlx_h2o.integration", "mlx_h2o.cli", "mlx_h2o.eval")
    assert violations("mlx_h2o.cache", False, bad) == []
