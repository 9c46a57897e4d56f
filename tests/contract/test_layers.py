"""The layers of ddpbus, held by walking every module's imports (docs/development.md).

From the bottom up, each layer may import only its own and the ones below it:

    codecs               wire formats; nothing of ddpbus above it
    orchestrator.core    pure decisions: the standard library and codecs, no I/O at all
    orchestrator.transport   the NATS connection and the job's logins
    orchestrator.persist     snapshots, journal, lease, bundles, the recorded stream
    orchestrator.runtime     the coordinator service, nats-server, provisioning, reducer...
    worker_agent         a rank's agent: uses the core, transport, persist and runtime
    orchestrator.tools   the ``ddpbus`` CLI and the operator's tools; above everything

Every import counts: module level, inside a function, and under ``TYPE_CHECKING`` (a cycle
of type-only imports is still two modules that cannot be read apart). No import cycle,
between modules of any layer, is allowed.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("codecs", "orchestrator.core", "orchestrator.transport", "orchestrator.persist",
          "orchestrator.runtime", "worker_agent", "orchestrator.tools")
# what the core may not import even from the standard library: it decides, it does no I/O
CORE_FORBIDDEN = {"asyncio", "threading", "socket", "subprocess", "signal", "selectors",
                  "concurrent", "multiprocessing", "os"}
# the third-party packages each layer may use (the core: none)
CODECS_ALLOWED = {"google", "grpc_tools"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder in ("codecs", "orchestrator", "worker_agent"):
        for path in (ROOT / folder).rglob("*.py"):
            if "_pb" in path.relative_to(ROOT).parts:
                continue  # generated protobuf code
            parts = ["ddpbus", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (ddpbus modules resolved to the module, not the name)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in MODULES else base)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(module: str) -> int | None:
    """The layer index of a ddpbus module (None: the orchestrator package itself)."""
    rest = module.removeprefix("ddpbus.")
    best = None
    for i, prefix in enumerate(LAYERS):
        if rest == prefix or rest.startswith(prefix + "."):
            best = i
    return best


def violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    bad = []
    for module, imported in graph.items():
        own = layer(module)
        for target in imported:
            top = target.split(".")[0]
            if module.startswith("ddpbus.orchestrator.core") and (
                    top in CORE_FORBIDDEN
                    or (top not in sys.stdlib_module_names and top != "ddpbus")):
                bad.append(f"{module} (core) imports {target}")
            if module.startswith("ddpbus.codecs") and top not in sys.stdlib_module_names \
                    and top not in CODECS_ALLOWED and top != "ddpbus":
                bad.append(f"{module} (codecs) imports {target}")
            if not target.startswith("ddpbus.") or own is None:
                continue
            theirs = layer(target)
            if theirs is not None and theirs > own:
                bad.append(f"{module} ({LAYERS[own]}) imports {target} ({LAYERS[theirs]})")
    return sorted(bad)


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_sits_in_a_layer() -> None:
    homeless = [m for m in MODULES if layer(m) is None and m != "ddpbus.orchestrator"]
    assert not homeless


def test_no_layer_imports_a_higher_one_and_the_core_does_no_io() -> None:
    assert violations(GRAPH) == []


def test_there_is_no_import_cycle() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(("graph", "expect"), [
    ({"ddpbus.orchestrator.core.x": {"asyncio"}}, "(core) imports asyncio"),
    ({"ddpbus.orchestrator.core.x": {"torch"}}, "(core) imports torch"),
    ({"ddpbus.orchestrator.core.x": {"ddpbus.orchestrator.runtime.y"}}, "imports ddpbus"),
    ({"ddpbus.worker_agent.a": {"ddpbus.orchestrator.tools.cli"}}, "(orchestrator.tools)"),
    ({"ddpbus.codecs.a": {"nats"}}, "(codecs) imports nats"),
])
def test_the_walk_sees_a_violation(graph: dict[str, set[str]], expect: str) -> None:
    assert any(expect in v for v in violations(graph)), violations(graph)


def test_the_walk_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert _imports("ddpbus.orchestrator.tools.cli", MODULES["ddpbus.orchestrator.tools.cli"])


def _spelled_subjects(path: Path) -> list[str]:
    """Where a module builds a job subject itself: ``sj.PREFIX`` used outside codecs, or an
    f-string that starts with ``ddpbus.``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "PREFIX" \
                and isinstance(node.value, ast.Name) and node.value.id == "sj":
            found.append(f"{path.name}:{node.lineno} sj.PREFIX")
        if isinstance(node, ast.JoinedStr) and node.values \
                and isinstance(node.values[0], ast.Constant) \
                and str(node.values[0].value).startswith("ddpbus."):
            found.append(f"{path.name}:{node.lineno} f\"{node.values[0].value}…\"")
    return found


def test_subjects_and_their_wildcards_come_only_from_codecs() -> None:
    """codecs/subjects.py spells every subject, wildcard and store name (issue 34: five
    modules used to rebuild ``f"{PREFIX}.{job}.>"`` by hand)."""
    spelled = [hit for name, path in MODULES.items() if not name.startswith("ddpbus.codecs")
               for hit in _spelled_subjects(path)]
    assert spelled == []
