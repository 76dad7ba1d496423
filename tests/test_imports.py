"""The package's import graph (read from the source with `ast`) and its one set of tables.

Module-level imports must form no cycle (a cycle makes import order matter and hides
half-initialized modules); function-level imports among the host layer and among the test
support (`cute_megamoe.testing`) must not either (they are only for optional or heavy
dependencies, not for breaking cycles). Each table (recipes,
architectures, BLOCK_M choices, kernels per arch) is defined once, in `cute_megamoe.tables`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import cute_megamoe

PACKAGE_DIR = Path(cute_megamoe.__file__).parent
PACKAGE = "cute_megamoe"
#: The host layer: the public entry points and what they are built from.
HOST_LAYER = ("api", "staged", "fused", "expert_gemm", "launch", "checks", "tables", "module",
              "deepgemm_api", "heuristics", "config", "runtime", "buffer", "utils", "quant",
              "reference")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking_block(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def _imports(module: str, module_level_only: bool) -> set[str]:
    """The package modules `module` imports (at module level, or anywhere)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if module_level_only:
        nodes = []
        stack = [n for n in tree.body if not _is_type_checking_block(n)]
        while stack:  # top-level statements, including try/if blocks, not function bodies
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, (ast.If, ast.Try)):
                stack += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)
                          and not _is_type_checking_block(n)]
    else:
        nodes = [n for n in ast.walk(tree) if not _is_type_checking_block(n)]
        skipped = {id(m) for n in ast.walk(tree) if _is_type_checking_block(n)
                   for m in ast.walk(n)}
        nodes = [n for n in nodes if id(n) not in skipped]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names}
    # (a package that contains `module` is imported before it anyway: not an edge)
    return {name for name in found
            if name in MODULES and name != module and not module.startswith(name + ".")}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_module_level_imports_have_no_cycle():
    graph = {m: _imports(m, module_level_only=True) for m in MODULES}
    assert len(graph) >= 30 and sum(len(v) for v in graph.values()) >= 50  # walked for real
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"
    # the entry points sit above the layers they use, never the other way round
    assert "cute_megamoe.staged" in graph["cute_megamoe.api"]
    assert "cute_megamoe.expert_gemm" in graph["cute_megamoe.staged"]
    for low in ("cute_megamoe.expert_gemm", "cute_megamoe.staged", "cute_megamoe.launch"):
        assert "cute_megamoe.api" not in _imports(low, module_level_only=False), low


def test_host_layer_has_no_cycle_through_function_level_imports():
    host = {f"{PACKAGE}.{name}" for name in HOST_LAYER}
    graph = {m: _imports(m, module_level_only=False) & host for m in host}
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_test_support_has_no_cycle_through_function_level_imports():
    """`cute_megamoe.testing`: the protocol checks and the fused layer's checks share their
    ranks (`testing.ranks`) rather than importing each other."""
    support = {m for m in MODULES if m.startswith(f"{PACKAGE}.testing.")}
    graph = {m: _imports(m, module_level_only=False) & support for m in support}
    assert len(graph) >= 10
    assert _find_cycle(graph) is None, f"import cycle: {' -> '.join(_find_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_one_tensor_check_and_one_set_of_tables():
    from cute_megamoe import expert_gemm, heuristics, layout, quant, runtime, tables

    defined = {m for m, path in MODULES.items()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name in ("check_tensor",
                                                                      "_check_tensor")}
    assert defined == {"cute_megamoe.checks"}
    assert quant.RECIPES is tables.RECIPES
    assert heuristics.BLOCK_M_CANDIDATES is tables.BLOCK_MS
    assert expert_gemm.SUPPORTED_RECIPES is tables.GEMM_RECIPES
    assert runtime.ARCH_BY_MAJOR is tables.ARCH_BY_MAJOR
    assert layout.RECIPES == tables.RECIPES  # (layout keeps its own copy of the names)
    assert tables.ARCHS == tuple(tables.GEMM_RECIPES) == tuple(tables.BLOCK_MS)
    assert set(tables.ARCH_BY_MAJOR.values()) == set(tables.ARCHS)


def test_one_public_arch_spelling():
    from cute_megamoe.heuristics import select_block_m
    from cute_megamoe.tables import normalize_arch

    for spelling in ("sm90", "sm90a", "sm_90a", "SM_90A"):
        assert normalize_arch(spelling) == "sm_90a"
    for spelling in ("sm100", "sm_100a", "sm100f"):
        assert normalize_arch(spelling) == "sm_100a"
    with pytest.raises(ValueError, match="arch: expected one of"):
        normalize_arch("sm80")
    with pytest.raises(TypeError, match="arch"):
        normalize_arch(90)
    assert select_block_m(1000.0, "sm90") == select_block_m(1000.0, "sm_90a") == 128
    # the short spellings appear only where a caller's input is normalized
    for name in ("api", "staged", "expert_gemm", "launch", "module", "deepgemm_api",
                 "heuristics", "checks"):
        text = MODULES[f"{PACKAGE}.{name}"].read_text()
        assert '"sm90"' not in text and '"sm100"' not in text, name


def test_package_imports_without_cuda_or_cute_dsl():
    """`import cute_megamoe` works on a CPU-only machine and does not load the CuTe DSL (it
    is imported by the launchers on first use)."""
    code = ("import sys, torch; torch.cuda.is_available = lambda: False; import cute_megamoe; "
            "print(sorted(m for m in ('cutlass', 'cutlass.cute') if m in sys.modules), "
            "len(cute_megamoe.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded, count = out.stdout.split("] ")
    assert loaded + "]" == "[]" and int(count) >= 14
