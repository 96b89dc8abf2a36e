"""The layers import downwards only: stages (tasks/) are thin entry points that import the library and never each
other, the library never imports tasks/ or flows/ (the CLI alone runs the flow), and the library's modules form no
import cycle, function-level imports included (such an import hides a cycle; it does not remove it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ultrathink.lineage import PROJECT_ROOT, imported_names

PACKAGES = ("ultrathink", "tasks", "flows")


def project_modules(root: Path = PROJECT_ROOT) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(root: Path = PROJECT_ROOT) -> dict[str, set[str]]:
    """Module → the project modules it imports anywhere in its source (`from a import b` counts as a.b when b is a
    module, else as a)."""
    modules = project_modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imported_names(name, path):
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def library_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The library's own edges; a package's __init__ re-exporting its submodules is not a dependency of them."""
    def is_reexport(source: str, target: str) -> bool:
        return target.startswith(source + ".")
    return {m: {t for t in edges if t.startswith("ultrathink") and not is_reexport(m, t)}
            for m, edges in graph.items() if m.startswith("ultrathink")}


def test_the_library_never_imports_stages_or_flows():
    graph = import_graph()
    wrong = {m: sorted(t for t in edges if t.split(".")[0] in ("tasks", "flows"))
             for m, edges in graph.items() if m.startswith("ultrathink") and m != "ultrathink.cli"}
    assert {m: t for m, t in wrong.items() if t} == {}
    cli = {t for t in graph["ultrathink.cli"] if t.split(".")[0] == "tasks"}
    assert cli == set(), "the CLI runs stages through ultrathink.stages, not tasks/"


def test_stages_do_not_import_each_other():
    graph = import_graph()
    crossing = {m: sorted(t for t in edges if t.startswith("tasks.") and t != m)
                for m, edges in graph.items() if m.startswith("tasks.")}
    assert {m: t for m, t in crossing.items() if t} == {}


def test_the_library_has_no_import_cycle():
    assert cycles(library_graph(import_graph())) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The library's subpackages (ultrathink.train, ultrathink.registry, ...; a top-level module stands for itself)
    and which of them import which."""
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])
    edges: dict[str, set[str]] = {}
    for module, targets in library_graph(graph).items():
        edges.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    return edges


def test_the_library_packages_have_no_import_cycle():
    """Layers, not only modules: e.g. the registry may use scoring and the model, but scoring, the model and
    fine-tuning must not reach back into the registry when the registry reaches into them."""
    assert cycles(package_graph(import_graph())) == []


def test_a_cycle_is_found_when_there_is_one(tmp_path):
    """The check can fail: a function-level import back from a module its importer needs is a cycle."""
    package = tmp_path / "ultrathink"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from ultrathink.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from ultrathink.a import f\n    return f\n")
    (package / "c.py").write_text("import ultrathink.a\n")
    for other in ("tasks", "flows"):
        (tmp_path / other).mkdir()
    assert cycles(library_graph(import_graph(tmp_path))) == [["ultrathink.a", "ultrathink.b"]]
    assert cycles(package_graph(import_graph(tmp_path))) == [["ultrathink.a", "ultrathink.b"]]  # each its own unit
    (package / "b.py").write_text("def g():\n    return 1\n")
    assert cycles(library_graph(import_graph(tmp_path))) == []


EDGE_TOOLS = ("mlflow", "prefect", "dvc")
EDGES = ("ultrathink.registry", "ultrathink.stages", "ultrathink.cli")


def test_only_the_edges_import_the_pipeline_tools():
    """MLflow, Prefect and DVC are imported only at the edges (the registry, the stages, the CLI): the model, data,
    training and scoring code stays importable and testable without them."""
    found = {}
    for name, path in project_modules().items():
        if name.startswith("ultrathink") and not name.startswith(EDGES):
            tools = {t.split(".")[0] for t in imported_names(name, path)} & set(EDGE_TOOLS)
            if tools:
                found[name] = sorted(tools)
    assert found == {}


@pytest.mark.spawns
def test_the_train_stage_imports_neither_transformers_nor_mlflow():
    """Each train stage, and each of its ranks, starts by importing ultrathink.stages.pretrain. It only hashes the
    tokenizer's files, so transformers (about a second to import) waits until a tokenizer is built or loaded; and
    only the main rank records in MLflow (2-3 s of CPU to import), so it waits until that rank records."""
    probe = ("import sys, ultrathink.stages.pretrain; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'mlflow')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.spawns
def test_the_promote_stages_import_transformers_only_to_export_a_new_version():
    """Only registering a new version exports it for transformers (registry.promote.log_hf_export); a promote that
    registers nothing new (a retry, weights this run registered before) and `ultrathink registry`'s task guard never
    need it, and it is about 3 s of such a process on a slow CPU. Nor does promoting read checkpoints: the sharded
    checkpoint code (torch.distributed.checkpoint, 0.7 s more) stays out too."""
    probe = ("import sys, ultrathink.stages.promote, ultrathink.stages.promote_finetuned, "
             "ultrathink.stages.promote_aligned, ultrathink.registry.promote; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'mlflow'}), "
             "'torch.distributed.checkpoint' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['mlflow'] False"


@pytest.mark.spawns
def test_a_warm_start_from_a_directory_imports_no_mlflow(tmp_path):
    """train.init_from or finetune.init_from naming a directory is resolved on every rank; only a registry name
    needs MLflow (pinning its alias), so a directory's ranks never import it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps({"format": "ultrathink"}))
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer/tokenizer.json").write_text("{}")
    probe = ("import sys; from ultrathink.registry.models import resolve_named_model; "
             f"named = resolve_named_model({str(tmp_path / 'model')!r}); "
             "print(named.files.tokenizer_dir.name, sorted(m for m in sys.modules if m.startswith('mlflow')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "tokenizer []"
