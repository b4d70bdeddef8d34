"""The layers are what the folders say: imports go only downward, read from the source itself.

Layers, bottom first (a module may import its own layer and the ones below it):
  common           nanokv/*.py: config, errors, messages, rpc, sampling, tracing (no service, no torch)
  kv               nanokv/kv/: KV formats, their (de)quantization reference, attention metadata
  kernels          kernels/: Triton/CUDA kernels and torch references; only kv below them
  protos           protos/: the contract and its codec
  cache_service    blocks, hashes, policies, the KV segment it owns
  compute_service  model, runner, sampler; maps the cache service's segment through kv
  gateway          scheduler, APIs, clients; starts the other two in process for LLM()
  router           router/: one front for many replicas (gateways), routing by KV events; no torch
  app              nanokv/__init__.py, cli.py, launch.py, torchrun.py: entry points
  tools            tools/nanokv_tools: bench, sim, eval (never imported by the product)
Imports under `if TYPE_CHECKING:` are for annotations only and do not count.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["common", "kv", "kernels", "protos", "cache_service", "compute_service", "gateway", "router", "app", "tools"]
SERVICES = ("kernels", "protos", "cache_service", "compute_service", "gateway", "router")
APP = ("__init__", "cli", "launch", "torchrun")
# which lower layers each layer may import; peers of one level are listed explicitly
ALLOWED = {
    "common": set(),
    "kv": {"common"},
    "kernels": {"kv"},  # and torch / triton: nothing else of nanokv's
    "protos": {"common"},
    "cache_service": {"common", "kv", "protos"},
    "compute_service": {"common", "kv", "kernels", "protos"},
    "gateway": {"common", "kv", "protos", "cache_service", "compute_service"},
    "router": {"common", "kv", "protos", "cache_service", "gateway"},
    "app": {"common", "kv", "protos", "cache_service", "compute_service", "gateway", "router"},
    "tools": set(ORDER[:-1]),
}


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] == "tools":
        return "tools"
    if rel[0] in SERVICES:
        return rel[0]
    if rel[1] == "kv":
        return "kv"
    return "app" if Path(rel[1]).stem in APP else "common"


def layer_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "nanokv_tools":
        return "tools"
    if parts[0] != "nanokv":
        return None
    if len(parts) == 1:
        return "app"
    if parts[1] in SERVICES:
        return parts[1]
    if parts[1] == "kv":
        return "kv"
    return "app" if parts[1] in APP else "common"


def runtime_imports(path: Path) -> list[str]:
    """Absolute imports of the module, anywhere in it (functions too), except TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from nanokv import tracing` imports the submodule nanokv.tracing
            names += [f"{node.module}.{a.name}" for a in node.names] if node.module == "nanokv" else [node.module]
    return names


def product_files() -> list[Path]:
    files = [p for d in SERVICES for p in (ROOT / d).rglob("*.py")]
    files += [p for p in (ROOT / "nanokv").rglob("*.py") if p.parent.name in ("nanokv", "kv")]
    return sorted(p for p in files if "_pb2" not in p.name)


def edges() -> list[tuple[str, str, str, str]]:
    """(from layer, to layer, file, module) for every import that crosses layers."""
    out = []
    files = product_files() + sorted((ROOT / "tools" / "nanokv_tools").rglob("*.py"))
    for path in files:
        src = layer_of_file(path)
        for mod in runtime_imports(path):
            dst = layer_of_module(mod)
            if dst is not None and dst != src:
                out.append((src, dst, str(path.relative_to(ROOT)), mod))
    return out


def test_imports_go_only_downward():
    bad = [e for e in edges() if e[1] not in ALLOWED[e[0]]]
    assert not bad, "\n".join(f"{f}: {a} imports {m} ({b})" for a, b, f, m in bad)


def test_no_import_cycles_between_top_level_folders():
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges():
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(m):] + [n, m]))
            if m not in state:
                visit(m, stack + [n] if m not in stack else stack)
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])


def test_kernels_import_only_kv_torch_and_triton():
    foreign = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for mod in runtime_imports(path):
            top = mod.split(".")[0]
            if top == "nanokv" and not mod.startswith(("nanokv.kv", "nanokv.kernels")):
                foreign.append(f"{path.name}: {mod}")
    assert not foreign, foreign


def test_product_never_imports_tools():
    hits = [f"{p.relative_to(ROOT)}: {m}" for p in product_files() for m in runtime_imports(p)
            if m.split(".")[0] == "nanokv_tools"]
    assert not hits, hits


def test_the_checker_sees_a_violation(tmp_path: Path):
    """The AST reader must see imports inside functions, and skip TYPE_CHECKING ones."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import nanokv.gateway\n"
                 "def g():\n    from nanokv.compute_service import service\n")
    assert runtime_imports(f) == ["typing", "nanokv.compute_service"]


GATEWAY_MODULES = sorted(  # and the router's: it runs where the gateway may run, without torch
    "nanokv." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for d in ("gateway", "router") for p in (ROOT / d).rglob("*.py"))


def test_every_gateway_module_imports_without_torch():
    """Each gateway module in a fresh interpreter: torch must not be in sys.modules afterwards."""
    script = ("import importlib, sys\nimportlib.import_module(sys.argv[1])\n"
              "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'nanokv_tools'))\n"
              "print(','.join(bad[:3]))\n")
    loaded = {}
    for mod in GATEWAY_MODULES:
        r = subprocess.run([sys.executable, "-c", script, mod], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{mod}: {r.stderr[-2000:]}"
        if r.stdout.strip():
            loaded[mod] = r.stdout.strip()
    assert len(GATEWAY_MODULES) > 30 and not loaded, loaded


def test_the_base_install_needs_no_torch():
    """`pip install nanokv` is the gateway: torch comes only with the services extra."""
    from importlib.metadata import requires

    reqs = requires("nanokv") or []
    base = [r for r in reqs if "extra ==" not in r]
    assert base and not [r for r in base if r.lower().startswith(("torch", "triton", "matplotlib"))], base
    assert any(r.startswith("torch") and 'extra == "services"' in r for r in reqs), reqs
