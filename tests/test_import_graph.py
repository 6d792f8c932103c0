"""The package's module graph: no import cycles, and the frontend process never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# installed name -> source folder (pyproject.toml maps them the same way)
PACKAGES = {
    "tokenmill": "tokenmill",
    "tokenmill.frontend": "frontend",
    "tokenmill.scheduler": "scheduler",
    "tokenmill.workers": "workers",
    "tokenmill.kernels": "kernels",
}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports anywhere, function-local imports included (a cycle hidden inside a
    function is still a cycle); only `if TYPE_CHECKING:` blocks are left out."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
        pending.extend(ast.iter_child_nodes(node))
    return {name for name in found if name in modules and name != module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def package_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_the_graph_sees_every_import():
    graph = package_graph()
    assert len(graph) > 40
    assert "tokenmill.workers.attention" in graph["tokenmill.workers.cpu_backend"]
    assert "tokenmill.workers.backends" in graph["tokenmill.workers.models.layers"]
    assert "tokenmill.workers.triton_backend" in graph["tokenmill.workers.backends"]  # a function-local import


def test_no_import_cycles():
    assert import_cycles(package_graph()) == []


def test_the_device_switch_depends_on_the_backends_and_not_the_other_way_round():
    graph = package_graph()
    for backend in ("attention", "cpu_backend", "triton_backend", "ops"):
        assert "tokenmill.workers.backends" not in graph[f"tokenmill.workers.{backend}"]
    # model layers reach kernels through the ops interface, never through an attention backend
    layers = graph["tokenmill.workers.models.layers"]
    assert not layers & {"tokenmill.workers.cpu_backend", "tokenmill.workers.triton_backend"}


def test_no_source_file_imports_a_generic_top_level_name():
    """Every import names `tokenmill.`: a bare `import scheduler` works only from the repository root."""
    offenders = []
    for path in [*REPO.glob("*/**/*.py")]:
        if ".git" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            offenders += [
                f"{path.relative_to(REPO)}: {n}"
                for n in names
                if n.split(".")[0] in ("frontend", "scheduler", "workers", "kernels")
            ]
    assert offenders == []


FRONTEND_PROCESS = """
import pkgutil, sys
import tokenmill.frontend
for module in pkgutil.iter_modules(tokenmill.frontend.__path__):
    __import__("tokenmill.frontend." + module.name)
import tokenmill.cli, tokenmill.serve, tokenmill.launcher, tokenmill.llm, tokenmill.model_source
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.model_source import resolve_config
from tokenmill.frontend.server import build_app
from tokenmill.frontend.tokenizer import load_tokenizer
from tokenmill.pooling_config import load_pooling_config

class Engine:  # what build_app reads of an EngineClient (metrics collected once at registration), without one
    dead_reason = None
    latest_stats = None
    ready = None
    summary_listener = None

    def replica_stats(self):
        return None

for task in ("generate", "embed"):
    config = resolve_config(EngineConfig(model=ModelConfig(task=task)))
    build_app(config, Engine(), load_tokenizer(config.model))
    if task == "embed":
        load_pooling_config(config.model.path, config.model.architecture)
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "triton"))
print("heavy:", loaded[:5])
"""


def test_the_frontend_process_never_imports_torch():
    """The API process (its modules, tokenizer loading for a GGUF and an HF model, the app) stays torch-free."""
    result = subprocess.run(
        [sys.executable, "-c", FRONTEND_PROCESS], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "heavy: []"


def test_only_the_ray_executor_imports_ray():
    """Ray is an optional extra: one module imports it, and nothing imports that module at the top level."""
    importers, top_level = set(), set()
    for module, path in package_modules().items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(name == "ray" or name.startswith("ray.") for name in names):
                importers.add(module)
        for node in tree.body:  # module-level statements only: function-local imports run on demand
            if isinstance(node, ast.ImportFrom) and node.module == "tokenmill.ray_executor":
                top_level.add(module)
    assert importers == {"tokenmill.ray_executor"}
    assert top_level == set()


MP_BACKEND = """
import sys
import tokenmill.cli, tokenmill.serve, tokenmill.llm, tokenmill.data_parallel
import tokenmill.workers.process, tokenmill.workers.worker, tokenmill.scheduler.process
from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.launcher import EngineProcesses

processes = EngineProcesses(EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)))
processes.stop()
print("ray:", sorted(name for name in sys.modules if name.split(".")[0] == "ray"))
"""


def test_the_mp_backend_never_imports_ray():
    result = subprocess.run([sys.executable, "-c", MP_BACKEND], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ray: []"
