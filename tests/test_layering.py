"""The code's layering stays true (docs/ARCHITECTURE.md §2 "Native layers", §6): native
includes only run downward through csrc/'s folders, along exactly the edges listed here; the
test tools stay out of the product; no binding takes more than 8 positional arguments
(settings cross as option structs), and the Python package imports without cycles."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from torchrec_bagpipe._native import C

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"

# The native layers, lowest first: a layer includes only layers before it. client (the
# trainer side of the PS protocol) and shard (the PS side) stand side by side; bindings/testing
# (the test-only module torchrec_bagpipe.testing._C_testing) is a layer of its own, so the
# product bindings cannot reach the test tools.
NATIVE_ORDER = ["common", "store", "protocol", "transport", "cache", "client", "shard", "server",
                "testing", "bindings", "bindings/testing"]
# What each layer includes besides itself: EXACTLY the edges the code uses (an edge listed
# here that no include uses fails too, so the table cannot drift from the code).
NATIVE_LAYERS: dict[str, set[str]] = {
    "common": set(),
    "store": {"common"},
    "protocol": {"common"},
    "transport": {"common", "protocol"},
    "cache": {"common"},
    "client": {"common", "store", "protocol", "transport"},
    "shard": {"common", "store", "protocol", "transport"},
    "server": {"common", "protocol", "transport"},
    "testing": {"common", "protocol", "transport"},
    "bindings": {"common", "store", "protocol", "transport", "cache", "client", "shard",
                 "server"},
    "bindings/testing": {"bindings", "shard", "testing"},
}
# The layers of the product library (CMakeLists.txt BAGPIPE_LAYERS); bindings are the
# extension modules above it, testing a library of its own.
PRODUCT_LAYERS = {"common", "store", "protocol", "transport", "cache", "client", "shard",
                  "server"}
# Not layers: the native tests may include any layer (and their own helpers).
NATIVE_UNCHECKED = {"tests"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
MAX_POSITIONAL = 8
# What the test tools export; none of it may be in the product module.
TEST_TOOL_NAMES = {"RawLink", "fuzz_server", "fuzz_ucx_server", "raw_loopback_seconds",
                   "raw_pingpong_seconds"}


def layer_of(path: str) -> str:
    """The layer of a csrc/-relative path (a file, or the target of an include)."""
    parts = path.split("/")
    if parts[0] == "bindings" and len(parts) > 2 and parts[1] == "testing":
        return "bindings/testing"
    return parts[0]


def native_includes() -> list[tuple[str, Path, str]]:
    """(layer, file, included path) for every quoted include of a csrc/ layer."""
    out = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".cc"):
            continue
        layer = layer_of(path.relative_to(CSRC).as_posix())
        if layer in NATIVE_UNCHECKED:
            continue
        for included in INCLUDE.findall(path.read_text()):
            out.append((layer, path, included))
    return out


def used_edges() -> set[tuple[str, str]]:
    return {(layer, layer_of(inc)) for layer, _, inc in native_includes()
            if layer_of(inc) != layer}


def test_every_native_folder_is_a_known_layer() -> None:
    folders = {p.name for p in CSRC.iterdir() if p.is_dir()}
    folders |= {f"bindings/{p.name}" for p in (CSRC / "bindings").iterdir() if p.is_dir()}
    assert folders - NATIVE_UNCHECKED == set(NATIVE_LAYERS) == set(NATIVE_ORDER), (
        "a new csrc/ folder must be placed in NATIVE_ORDER and NATIVE_LAYERS (and "
        "docs/ARCHITECTURE.md)"
    )


def test_the_layer_table_runs_downward() -> None:
    rank = {layer: i for i, layer in enumerate(NATIVE_ORDER)}
    upward = [f"{a} -> {b}" for a, deps in NATIVE_LAYERS.items() for b in deps
              if rank[b] >= rank[a]]
    assert not upward, upward


def test_native_includes_follow_the_layer_table() -> None:
    upward = []
    for layer, path, included in native_includes():
        target = layer_of(included)
        if target != layer and target not in NATIVE_LAYERS[layer]:
            upward.append(f"{path.relative_to(REPO)} includes {included}")
    assert not upward, "includes against the layer order:\n" + "\n".join(upward)


def test_every_allowed_edge_is_used() -> None:
    allowed = {(a, b) for a, deps in NATIVE_LAYERS.items() for b in deps}
    assert allowed - used_edges() == set(), "edges no include uses: drop them from NATIVE_LAYERS"


def test_the_include_check_sees_an_upward_include() -> None:
    # The check itself: the real tree has includes of every kind it judges.
    edges = used_edges()
    assert ("shard", "transport") in edges and ("server", "transport") in edges
    assert "shard" not in NATIVE_LAYERS["transport"] and "client" not in NATIVE_LAYERS["shard"]
    assert layer_of("bindings/testing/fuzz.cc") == "bindings/testing"


def test_the_product_library_is_the_product_layers() -> None:
    cmake = (REPO / "CMakeLists.txt").read_text()
    m = re.search(r"^set\(BAGPIPE_LAYERS ([^)]*)\)", cmake, re.MULTILINE)
    assert m, "CMakeLists.txt no longer sets BAGPIPE_LAYERS"
    assert set(m.group(1).split()) == PRODUCT_LAYERS
    assert all("testing" not in NATIVE_LAYERS[layer] for layer in PRODUCT_LAYERS | {"bindings"})


def test_the_product_module_carries_no_test_tools() -> None:
    assert TEST_TOOL_NAMES.isdisjoint(dir(C)), TEST_TOOL_NAMES & set(dir(C))
    assert not [n for n in dir(C) if "fuzz" in n.lower() or "raw" in n.lower()]
    from torchrec_bagpipe.testing import _C_testing as tools  # built by `make build`

    want = TEST_TOOL_NAMES - (set() if C.HAVE_UCX else {"fuzz_ucx_server"})
    assert want <= set(dir(tools))


# ---- bindings -------------------------------------------------------------------------------
def _split_params(text: str) -> list[str]:
    """Top-level comma split of a pybind11 signature's parameter list."""
    params, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        params.append(cur.strip())
    return params


def _signatures(name: str, doc: str | None) -> list[list[str]]:
    """The parameter lists of every overload of `name` in a pybind11 docstring."""
    out = []
    for line in (doc or "").splitlines():
        m = re.match(rf"^\s*(?:\d+\.\s*)?{re.escape(name)}\((.*)\)\s*(?:->.*)?$", line)
        if m:
            out.append(_split_params(m.group(1)))
    return out


def _binding_callables() -> list[tuple[str, str, str | None]]:
    """(qualified name, name, docstring) of every function and method of the extension."""
    out = []
    for attr in dir(C):
        obj = getattr(C, attr)
        if isinstance(obj, type):
            for meth in ("__init__", *(m for m in vars(obj) if not m.startswith("__"))):
                fn = getattr(obj, meth, None)
                if callable(fn) and not isinstance(vars(obj).get(meth), property):
                    out.append((f"{attr}.{meth}", meth, getattr(fn, "__doc__", None)))
        elif callable(obj) and type(obj).__name__ == "builtin_function_or_method":
            out.append((attr, attr, obj.__doc__))
    return out


def test_no_binding_takes_more_than_eight_positional_arguments() -> None:
    checked, long_lists = 0, []
    for qualname, name, doc in _binding_callables():
        for params in _signatures(name, doc):
            params = [p for p in params if not p.startswith("self")]
            checked += 1
            if len(params) > MAX_POSITIONAL:
                long_lists.append(f"{qualname}: {len(params)} arguments")
    assert checked > 50, f"only {checked} binding signatures parsed: the parser is broken"
    assert not long_lists, "use an options struct (csrc/bindings/options.cc):\n" + "\n".join(
        long_lists
    )


def test_option_structs_cross_the_binding_boundary() -> None:
    o = C.ClientOptions()
    o.partition = "hash"
    o.init.kind = "zeros"  # a nested struct is the field itself, not a copy
    assert o.partition == "hash" and o.init.kind == "zeros"
    spec = C.InitSpec()
    spec.kind = "constant"
    o.init = spec
    assert o.init.kind == "constant"
    with pytest.raises(ValueError, match="partitioner"):
        o.partition = "round_robin"
    with pytest.raises(ValueError, match="init"):
        spec.kind = "normal"


# ---- Python imports ---------------------------------------------------------------------------
# The package's layers, lowest first (docs/ARCHITECTURE.md §6, DESIGN §3): a layer imports only
# layers before it, and exactly the ones listed (every listed edge is used, so the table
# cannot drift from the code). The top-level tools (`demo`, `metrics_table`) are layers too.
PYTHON_ORDER = ["config", "ps", "runtime", "distributed", "launch", "datasets", "testing",
                "demo", "metrics_table"]
PYTHON_LAYERS: dict[str, set[str]] = {
    "config": set(),
    "ps": {"config"},
    "runtime": {"config", "ps"},
    "distributed": {"config", "ps", "runtime"},
    "launch": {"distributed"},
    "datasets": set(),
    "testing": {"config", "ps", "runtime"},
    "demo": {"ps"},
    "metrics_table": set(),
}
# Not layers: what every layer may use (the package root, its lazy names, the native module).
PYTHON_BASE = {"torchrec_bagpipe", "torchrec_bagpipe._lazy", "torchrec_bagpipe._native"}


def _python_import_graph() -> dict[str, set[str]]:
    """torchrec_bagpipe module -> the package's modules it imports (anywhere in the file,
    function-level imports included)."""
    mods: dict[str, Path] = {}
    for path in (REPO / "torchrec_bagpipe").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in mods:
                        graph[mod].add(full)
                    elif node.module in mods:
                        graph[mod].add(node.module)
    return graph


def _layer_of(module: str) -> str | None:
    """The layer of a package module (None: a base module)."""
    if module in PYTHON_BASE:
        return None
    return module.split(".")[1]


def _layer_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(layer, imported layer) -> the imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for mod, targets in graph.items():
        for target in targets:
            a, b = _layer_of(mod), _layer_of(target)
            if a is not None and b is not None and a != b:
                edges.setdefault((a, b), []).append(f"{mod} imports {target}")
    return edges


def test_every_python_module_is_in_a_known_layer() -> None:
    layers = {_layer_of(m) for m in _python_import_graph()} - {None}
    assert layers == set(PYTHON_LAYERS), (
        "a new torchrec_bagpipe subpackage or top-level module must be placed in "
        "PYTHON_LAYERS (and docs/ARCHITECTURE.md)"
    )
    assert set(PYTHON_ORDER) == set(PYTHON_LAYERS)


def test_the_layer_table_follows_the_layer_order() -> None:
    for layer, allowed in PYTHON_LAYERS.items():
        below = set(PYTHON_ORDER[:PYTHON_ORDER.index(layer)])
        assert allowed <= below, f"{layer} may import {sorted(allowed - below)}: not below it"


def test_python_layers_import_exactly_their_allowed_layers() -> None:
    edges = _layer_edges(_python_import_graph())
    allowed = {(a, b) for a, targets in PYTHON_LAYERS.items() for b in targets}
    upward = [why for edge, whys in sorted(edges.items()) if edge not in allowed
              for why in whys]
    assert not upward, "imports against the layer table:\n" + "\n".join(upward)
    unused = sorted(allowed - set(edges))
    assert not unused, f"allowed edges no module uses (remove them from PYTHON_LAYERS): {unused}"


def test_the_layer_check_sees_an_upward_import() -> None:
    edges = _layer_edges({"torchrec_bagpipe.ps.x": {"torchrec_bagpipe.runtime.y"},
                          "torchrec_bagpipe.runtime.y": {"torchrec_bagpipe._native"}})
    assert edges == {
        ("ps", "runtime"): ["torchrec_bagpipe.ps.x imports torchrec_bagpipe.runtime.y"]}
    assert "runtime" not in PYTHON_LAYERS["ps"]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_python_modules_import_without_cycles() -> None:
    graph = _python_import_graph()
    assert "torchrec_bagpipe.ps.client_spec" in graph["torchrec_bagpipe.ps.client"]
    assert not _cycles(graph), _cycles(graph)


def test_the_cycle_check_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
