"""The layering rules of ``docs/architecture.md``, checked on the source: which module may import which, no
import cycles, and modules and functions of a readable size. Parsed with ``ast`` (imports inside functions
and under ``TYPE_CHECKING`` count too: a cycle for the type checker is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tensorcast"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The tensorcast modules ``path`` imports (``from a.b import c`` counts as ``a.b.c`` when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tensorcast"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tensorcast"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if m in known}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    # A package's __init__ only re-exports: importing it stands for the submodules it imports.
    return {name: _imports(path, known) - {name} for name, path in mods.items()}


def _is(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# (importer prefixes, forbidden import prefixes, why)
RULES: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("tensorcast.records", "tensorcast.errors", "tensorcast.checksums", "tensorcast.context",
      "tensorcast.config", "tensorcast.config_loading", "tensorcast.cuda", "tensorcast.clock"),
     ("tensorcast.pool", "tensorcast.wire", "tensorcast.transport", "tensorcast.client", "tensorcast.worker",
      "tensorcast.gs", "tensorcast.kv", "tensorcast.plans", "tensorcast.tensors", "tensorcast.views"),
     "the ground floor imports nothing above it"),
    (("tensorcast.pool", "tensorcast.tensors", "tensorcast.views", "tensorcast.weights", "tensorcast.kv.keys",
      "tensorcast.kv.hrw", "tensorcast.kv.leases", "tensorcast.kv.pages", "tensorcast.kv.custody",
      "tensorcast.kv.reconcile",
      "tensorcast.plans.state"),
     ("tensorcast.wire", "tensorcast.transport", "tensorcast.client", "tensorcast.worker", "tensorcast.gs",
      "tensorcast.cluster", "tensorcast.cli"),
     "storage, identity, weights and pure rules know no protocol, sockets or processes"),
    (("tensorcast.wire", "tensorcast.transport"),
     ("tensorcast.client", "tensorcast.worker", "tensorcast.gs", "tensorcast.kv.home", "tensorcast.kv.serving",
      "tensorcast.kv.handover", "tensorcast.plans.executor", "tensorcast.plans.ops", "tensorcast.cluster",
      "tensorcast.cli"),
     "the protocol and the data plane serve every role and know none"),
    (("tensorcast.gs",),
     ("tensorcast.worker", "tensorcast.client", "tensorcast.transport", "tensorcast.pool"),
     "the global store holds metadata only: no bytes, no workers' internals"),
    (("tensorcast.client",),
     ("tensorcast.worker", "tensorcast.gs", "tensorcast.cluster"),
     "a caller talks to processes, it does not embed them"),
    (("tensorcast.obs",),
     ("tensorcast.pool", "tensorcast.wire", "tensorcast.transport", "tensorcast.client", "tensorcast.worker",
      "tensorcast.gs", "tensorcast.kv", "tensorcast.plans", "tensorcast.tensors", "tensorcast.views",
      "tensorcast.cluster", "tensorcast.cli"),
     "observability sits beside the ground floor: every layer records into it, it reads no role's state itself"),
    (("tensorcast.worker", "tensorcast.kv.home", "tensorcast.kv.serving", "tensorcast.kv.handover"),
     ("tensorcast.client", "tensorcast.cluster", "tensorcast.cli"),
     "a worker does not call itself through the caller SDK"),
    (("tensorcast.api", "tensorcast.integrations"),
     ("tensorcast.worker", "tensorcast.gs", "tensorcast.cluster", "tensorcast.kv.home", "tensorcast.kv.serving",
      "tensorcast.kv.handover", "tensorcast.wire",
      "tensorcast.transport", "tensorcast.cli"),
     "engine-facing APIs and engine plugins sit on the caller SDK"),
    (("tensorcast.policies", "tensorcast.workloads", "tensorcast.sim"),
     ("tensorcast.worker", "tensorcast.gs", "tensorcast.cluster", "tensorcast.kv", "tensorcast.wire",
      "tensorcast.transport", "tensorcast.cli", "tensorcast.pool", "tensorcast.client", "tensorcast.instance"),
     "caller policies, workloads and the simulator use the public API and its signals only"),
]


def test_layering_rules() -> None:
    graph = _graph()
    broken = []
    for importers, forbidden, why in RULES:
        for mod, deps in graph.items():
            if not _is(mod, *importers):
                continue
            for dep in deps:
                if _is(dep, *forbidden):
                    broken.append(f"{mod} imports {dep}: {why}")
    assert not broken, "\n".join(sorted(broken))


def test_no_import_cycles() -> None:
    graph = _graph()
    # Packages' __init__ modules re-export their submodules; an edge into a package is an edge into what it
    # re-exports, so cycles through __init__ are real cycles. Tarjan's strongly connected components:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # A package importing its own submodules (to re-export them) is not a cycle unless a submodule imports
    # the package back; the components above already include only modules that reach each other.
    assert not cycles, f"import cycles: {cycles}"


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines (> {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {size} lines (> {MAX_FUNCTION_LINES})")
    assert not too_long, "\n".join(sorted(too_long))


def _private_names_defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: its functions and methods, and attributes it assigns (``x._a = ...``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name.startswith("_"):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
            out.add(node.attr)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.startswith("_"))
    return out


def test_no_module_uses_another_modules_private_members() -> None:
    """``obj._name`` appears only in the module that defines ``_name`` (or on ``self``: a subclass's own)."""
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        mine = _private_names_defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in mine and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                offenders.append(f"{name}:{node.lineno}: .{node.attr}")
    assert not offenders, "\n".join(offenders)


def test_the_where_is_x_table_matches_the_tree() -> None:
    """Every folder and file the "Where is X" table of ``docs/architecture.md`` names exists."""
    import re

    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    table = doc.split("<!-- where-is-x -->", 1)[1].split("<!-- /where-is-x -->", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    assert len(rows) >= 20
    named = {p for row in rows for cell in row.split("|")[2:4] for p in re.findall(r"`([\w/]+(?:\.py|/))`", cell)}
    missing = sorted(p for p in named if not (SRC / p).exists())
    assert not missing, f"the table names paths that do not exist: {missing}"
