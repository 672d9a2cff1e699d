"""The package's layout as a rule that lasts: the top level holds only the entry points, the config and
the exit contract; folders import downward only (in LAYERS order); no two files import each other,
directly or around a circle. Imports inside functions count: they are imports all the same."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "dflash_dist"
TOP_MODULES = {"__init__", "config", "exits", "train", "evaluate"}
GROUND = {"config", "exits"}  # imported by everything, import nothing of the project
ENTRY = {"train", "evaluate"}  # python -m entry points: nothing imports them
# Lowest first: a folder may import the folders before it (and the ground floor), never one after it.
LAYERS = ["io", "runtime", "models", "observe", "data", "parallel", "plan", "checkpoints", "training", "forecast", "evaluation",
          "roles", "report", "bench"]


def module_name(path: Path, root: Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str], root: Path = PKG) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` resolves to the module where one exists)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == root.name}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != root.name:
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return out - {me}


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    return {m: project_imports(p, set(files), root) for m, p in files.items()}


def room(module: str) -> str:
    """The top-level folder (or top-level module) a module lives in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_errors(graph: dict[str, set[str]]) -> list[str]:
    errors = []
    for m, deps in sorted(graph.items()):
        src = room(m)
        for d in sorted(deps):
            dst = room(d)
            if dst in (src, "") and not (src == "" and m.count(".") == 0):
                continue  # inside one folder (file cycles are checked apart); the package's own __init__
            if src in GROUND:
                errors.append(f"{m} imports {d}: {src}.py is the ground floor and imports nothing of the project")
            elif dst in ENTRY:
                errors.append(f"{m} imports the entry point {d}: import what it wraps instead")
            elif dst in GROUND or src in ENTRY:
                continue
            elif dst not in LAYERS or src not in LAYERS:
                errors.append(f"{m} -> {d}: {dst if dst not in LAYERS else src}/ is not in LAYERS (add it in its place)")
            elif LAYERS.index(dst) > LAYERS.index(src):
                errors.append(f"{m} imports {d}: {src}/ may import only lower folders (earlier in LAYERS), and {dst}/ is higher")
    return errors


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_top_level_holds_only_entry_points_config_and_exit_contract():
    assert {p.stem for p in PKG.glob("*.py")} == TOP_MODULES
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


def test_every_folder_says_what_it_holds_and_may_import():
    for init in [p / "__init__.py" for p in PKG.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        assert init.is_file(), f"{init.parent} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init} needs a docstring: what the folder holds and what it may import"


def test_folders_import_downward_only():
    assert layering_errors(import_graph()) == []


def test_no_import_circle_between_files():
    assert cycles(import_graph()) == []


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    """The rules on a small package of the same shape: each bad import is reported."""
    pkg = tmp_path / "dflash_dist"
    for folder, text in {"models": "from dflash_dist.roles.drafter import x\n",  # upward
                         "roles": "from dflash_dist.models.a import y\n"}.items():
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text('"""doc"""\n')
        (pkg / folder / ("a.py" if folder == "models" else "drafter.py")).write_text(text)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from dflash_dist.models import a\n")  # the ground floor importing upward
    (pkg / "models" / "b.py").write_text("import dflash_dist.models.c\n")
    (pkg / "models" / "c.py").write_text("from dflash_dist.models import b\n")  # a circle inside a folder
    graph = import_graph(pkg)
    errors = layering_errors(graph)
    assert any("dflash_dist.models.a imports dflash_dist.roles.drafter" in e for e in errors), errors
    assert any(e.startswith("dflash_dist.config imports") for e in errors), errors
    assert len(errors) == 2
    assert sorted(cycles(graph)) == [["dflash_dist.models.a", "dflash_dist.roles.drafter"],
                                     ["dflash_dist.models.b", "dflash_dist.models.c"]]
