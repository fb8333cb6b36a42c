"""The package's shape, held to docs/internals.md: imports point down the layers
(lazy imports and imports for type checking included), no module imports one of a
higher layer, no two modules import each other in a cycle, torch.distributed is
imported by collective.py alone, and no module keeps mutable state at module level
but the one owner (runtime.PROCESS)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardpoint"

#: Lowest first; a module may import its own layer's modules and lower layers'.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_version", "_gc", "_memory", "runtime"),
    ("format", "report"),
    ("plan",),
    ("storage", "layout", "tree", "collective", "elastic"),
    ("adapters", "_rng", "_optim", "health"),
    ("saving", "load"),
    ("api", "_export", "verify"),
    ("state", "tiers"),
    ("manager",),
    ("cli", "integrations", "interop", "__init__"),
]


def _name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
    return ".".join(("shardpoint", *parts))


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it to LAYERS (and docs/internals.md)")


def _imports(path: Path) -> set[str]:
    """The shardpoint modules ``path`` imports, anywhere in it, relative imports resolved."""
    pkg = _name(path).split(".") if path.name == "__init__.py" else _name(path).split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("shardpoint"))
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if not mod.startswith("shardpoint"):
                continue
            out.add(mod)
            for a in node.names:  # `from . import x`: x may be a module
                if (SRC.parent / (mod + "." + a.name).replace(".", "/")).with_suffix(".py").exists() or \
                        (SRC.parent / (mod + "." + a.name).replace(".", "/")).is_dir():
                    out.add(f"{mod}.{a.name}")
    return out


def _graph() -> dict[str, set[str]]:
    mods = {_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for m, p in mods.items():
        # a submodule importing its own package's __init__ is how Python imports it anyway
        graph[m] = {i for i in _imports(p) if i in mods and i != m and not m.startswith(i + ".")}
    return graph


def test_imports_point_down_the_layers() -> None:
    graph = _graph()
    assert len(graph) > 50 and "shardpoint.saving.pipeline" in graph and "shardpoint.runtime" in graph
    up = sorted(f"{m} -> {i}" for m, deps in graph.items() for i in deps
                if _layer(i) > _layer(m) and not m.startswith("shardpoint.__init__"))
    assert up == [], "imports that run back up a layer:\n" + "\n".join(up)


def test_no_import_cycle() -> None:
    graph = _graph()
    # packages' __init__ files re-export their modules: an edge into a package is an edge into its __init__
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    own = [c for c in cycles if not any(x == "shardpoint" for x in c)]
    assert own == [], "import cycles: " + "; ".join(" -> ".join(c) for c in own)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports under ``if TYPE_CHECKING:`` (types for the checker; never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out.update(n.lineno for b in node.body for n in ast.walk(b) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


def test_only_collective_imports_torch_distributed() -> None:
    allowed = {"collective.py"}
    core = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in ("integrations", "interop")]
    bad = []
    for p in core:
        tree = ast.parse(p.read_text())
        types_only = _type_checking_only(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in types_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.startswith("torch.distributed") for n in names) and str(p.relative_to(SRC)) not in allowed:
                bad.append(f"{p.relative_to(SRC)}:{node.lineno}")
    # layout/ reads a DTensor's placements: it imports torch.distributed.tensor's types, not the process group
    bad = [b for b in bad if not b.startswith("layout/")]
    assert bad == [], f"torch.distributed imported outside collective.py: {bad}"


def _mutable_module_state(path: Path) -> list[str]:
    """Module-level names bound to a mutable container, or to an object made by a call
    that is not a known constant maker."""
    constant_calls = {"TypeVar", "frozenset", "tuple", "int", "float", "str", "bool", "timedelta", "compile",
                      "getLogger", "get", "_env_size", "_env_seconds", "MappingProxyType", "namedtuple", "fromtimestamp",
                      "Lock",  # a lock guards state, it holds none
                      "Decoder", "Encoder",  # msgspec's: built once, hold no state (as re.compile's patterns)
                      "attrgetter", "itemgetter",  # operator's: a fixed look-up, no state
                      "slice"}  # immutable, as a tuple
    tree = ast.parse(path.read_text())
    mutated: set[str] = set()  # names assigned into or changed by a method anywhere in the module
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            mutated.update(t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.attr in ("update", "setdefault", "pop", "popitem", "append", "extend", "clear", "add",
                                       "remove", "discard", "insert"):
            mutated.add(node.func.value.id)
        elif isinstance(node, ast.Global):
            mutated.update(node.names)
    out = []
    for n in tree.body:
        if not isinstance(n, (ast.Assign, ast.AnnAssign)) or n.value is None:
            continue
        targets = n.targets if isinstance(n, ast.Assign) else [n.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if not names or names == ["__all__"]:
            continue
        v = n.value
        if isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            if all(x.lstrip("_").isupper() and x not in mutated for x in names):
                continue  # an upper-case table that nothing in its module changes
            out.append(f"{path.relative_to(SRC)}:{n.lineno} {names}")
        elif isinstance(v, ast.Call):
            f = v.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            fixed_view = fname == "cast" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call) \
                and isinstance(f.value.func, ast.Name) and f.value.func.id == "memoryview"  # a view of fixed memory
            if fname not in constant_calls and not fixed_view:
                out.append(f"{path.relative_to(SRC)}:{n.lineno} {names}")
    return out


def test_no_mutable_module_state_but_the_owner() -> None:
    found = [x for p in sorted(SRC.rglob("*.py")) for x in _mutable_module_state(p)]
    allowed = {"runtime.py"}  # PROCESS itself
    found = [f for f in found if f.split(":")[0] not in allowed]
    assert found == [], "module-level mutable state outside runtime.PROCESS: " + ", ".join(found)
