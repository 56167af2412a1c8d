"""The package's dependencies point one way (read from the source with ``ast``, no import runs).

    cli -> drill / port / analysis -> train -> metrics -> optim -> parallel -> models -> ops
        -> sharding -> mesh -> config -> layout -> axes

Every package sits in a tier of its own. A module may import modules of its own tier or a lower one,
never a higher one; no two modules import each other, directly or around a cycle, and no two
packages (or top-level modules) import each other at all (function-local imports count: hiding an
import in a function does not change which way the arrow runs). No module uses another module's
private name (``from jaxpar.x import _y``, or ``x._y`` on an imported jaxpar module): what another
module needs is public.
"""

from __future__ import annotations

import ast
import functools
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxpar"

# Top-level modules / packages of jaxpar (or a dotted submodule that sits lower than its package),
# lowest tier first.
TIERS: tuple[tuple[str, ...], ...] = (
    (
        "axes",
        "errors",
        "children",
        "compat",
        "console",
        "files",
        "host_memory",
        "interrupt",
        "isolated",
        "versions",
        "write_guard",
    ),
    ("layout", "models.registry", "optim.fields", "workdir"),  # need no config: config.validate calls them
    ("acts",),  # the fields' conditions: config.validate calls it
    ("config",),
    ("mesh", "distributed"),
    ("sharding", "data", "data_megatron", "checkpoint", "environment"),
    ("ops",),  # shard-local kernels: attention, context exchange, dense, dropout, ZeRO-3 gathers, remat
    ("models",),  # built from ops, never from parallel
    ("parallel",),  # ZeRO's gradient side and the pipeline: they run a Model
    ("optim",),  # jaxpar's AdamW updates ZeRO's local shards (parallel.zero)
    ("metrics",),
    ("train",),
    ("analysis",),
    ("port",),
    ("drill",),
    ("cli", "__main__", "__init__"),
)
TIER = {name: rank for rank, names in enumerate(TIERS) for name in names}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, name: str) -> set[str]:
    """jaxpar modules ``path`` imports (absolute or relative, at any depth of the file)."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "jaxpar")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "jaxpar":
                continue
            submodules = {f"{module}.{a.name}" for a in node.names}  # `from jaxpar import train`
            out.update(submodules)
            if module != "jaxpar":  # `from jaxpar import x` imports x, not the package's __init__
                out.add(module)
    return out


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    """The package's import graph, parsed once per process (CPython 3.11's ``ast.parse`` has raised
    "AST constructor recursion depth mismatch" when called again deep in a test worker's stack)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = frozenset(m for m in _imports(path, name) if m in files and m != name)
    return graph


def _top(module: str) -> str:
    """The TIERS key of a module: its most specific listed dotted name under jaxpar."""
    parts = module.split(".")[1:] or ["__init__"]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in TIER:
            return ".".join(parts[:n])
    return parts[0]


def test_every_module_has_a_tier():
    missing = sorted({_top(m) for m in _graph()} - set(TIER))
    assert not missing, f"add {missing} to TIERS in tests/test_imports.py"


def test_imports_point_down_the_tiers():
    wrong = [
        f"{module} (tier {TIER[_top(module)]}) imports {target} (tier {TIER[_top(target)]})"
        for module, targets in _graph().items()
        for target in targets
        if TIER[_top(target)] > TIER[_top(module)]
    ]
    assert not wrong, "imports against the order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    # Package __init__ modules re-export their submodules; an edge into a package means "some
    # submodule of it", so cycles are looked for between plain modules.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _packages() -> set[str]:
    """The TIERS keys that are packages (a folder with ``__init__.py``)."""
    return {name for name in TIER if (PACKAGE / name.replace(".", "/") / "__init__.py").is_file()}


def test_every_package_has_a_tier_of_its_own():
    shared = [names for names in TIERS if len(set(names) & _packages()) > 1]
    assert not shared, f"packages sharing a tier: {shared}; give each its own in tests/test_imports.py"


def test_no_two_packages_import_each_other():
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in _graph().items():
        for target in targets:
            a, b = _top(module), _top(target)
            if a != b:
                edges.setdefault((a, b), []).append(f"{module} -> {target}")
    ties = [
        f"{a} <-> {b}: {', '.join(edges[(a, b)])}; {', '.join(edges[(b, a)])}"
        for a, b in sorted(edges)
        if a < b and (b, a) in edges
    ]
    assert not ties, "packages that import each other:\n" + "\n".join(ties)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: pathlib.Path, name: str, modules: set[str]) -> list[str]:
    """Another jaxpar module's private names that ``path`` uses: imported by name, or read as an
    attribute of an imported jaxpar module (``attn._flash``, ``jaxpar.models.llama._block``)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    aliases: dict[str, str] = {}  # local name -> the jaxpar module it is bound to
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "jaxpar":
                continue
            for a in node.names:
                if f"{module}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
                elif _is_private(a.name) and module != name:
                    out.append(f"{name}:{node.lineno}: from {module} import {a.name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        parts, value = [], node.value
        while isinstance(value, ast.Attribute):
            parts.append(value.attr)
            value = value.value
        if not isinstance(value, ast.Name):
            continue
        if not parts and value.id in aliases:
            owner = aliases[value.id]
        elif value.id == "jaxpar":
            owner = ".".join(["jaxpar", *reversed(parts)])
        else:
            continue
        if owner in modules and owner != name:
            out.append(f"{name}:{node.lineno}: {owner}.{node.attr}")
    return out


def test_no_module_uses_another_modules_private_name():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    uses = [use for name, path in sorted(files.items()) for use in _private_uses(path, name, set(files))]
    assert not uses, "private names used outside their module (make them public or move them):\n" + "\n".join(uses)


def test_the_command_line_does_not_import_jax_at_load():
    """``jaxpar port`` and the parsers never need JAX, and the simulated device count is set before JAX
    starts: importing the command line loads neither JAX nor optax (the executors, the optimizer
    registry and the sharding rules that use them are imported where they run); nor does validating a
    config, the optimizer's fields included (a field lion does not read is refused), nor a whole
    ``jaxpar port`` of a DeepSpeed recipe (about 2 s of JAX's import saved per port)."""
    import subprocess
    import sys

    code = (
        "import sys, jaxpar.cli\n"
        "from jaxpar.config import ConfigError, load_config\n"
        "load_config(None, ['--config.optim.name=sgd', '--config.optim.momentum=0.5'])\n"
        "try:\n"
        "    load_config(None, ['--config.optim.name=lion', '--config.optim.momentum=0.5'])\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
        "import tempfile\n"
        "from jaxpar.cli import main\n"
        "out = tempfile.mkdtemp() + '/ported.py'\n"
        "recipe = 'tests/fixtures/recipes/deepspeed/adam_l2_cosine_autocast.json'\n"
        "assert main(['port', 'deepspeed', recipe, '--world-size', '8', '--approximate', '-o', out]) == 0\n"
        "print(sorted(m for m in ('jax', 'optax', 'flax') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()  # the refusal, the port's report, the modules loaded
    refused, loaded = lines[0], lines[-1]
    assert refused.startswith("optim.momentum=0.5 has no effect with optim.name='lion'"), refused
    assert loaded == "[]"
