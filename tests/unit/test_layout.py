"""The package's layout as a rule that lasts: the top level holds only the entry points, the config and
the exit contract; each folder imports only what MAY_IMPORT allows it (a graph without a circle, so
folders still import downward), and its __init__.py says so in its "May import:" line; no two files
import each other, directly or around a circle. Imports inside functions count: they are imports all
the same."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "dflash_dist"
TOP_MODULES = {"__init__", "config", "exits", "train", "evaluate"}
GROUND = {"config", "exits"}  # imported by everything, import nothing of the project
ENTRY = {"train", "evaluate"}  # python -m entry points: nothing imports them
# The layering rule, stated once: what each folder may import (folders as "name/", top-level modules as
# "name.py"). Each folder's __init__.py docstring has a "May import:" line naming the same set
# (test_every_folder_may_import_what_its_docstring_says). Folders that need nothing of each other stay
# apart (models/ and observe/, io/ and runtime/, report/ and the rest), where a total order would rank them.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "io": ("config.py",),
    "runtime": ("exits.py",),
    "models": ("io/", "config.py", "exits.py"),
    "observe": ("io/", "config.py", "exits.py"),
    "data": ("models/", "observe/", "runtime/", "io/", "config.py", "exits.py"),
    "parallel": ("data/", "models/", "observe/", "runtime/", "io/", "config.py", "exits.py"),
    "plan": ("parallel/", "data/", "models/", "observe/", "io/", "config.py", "exits.py"),
    "checkpoints": ("plan/", "io/", "config.py", "exits.py"),
    "training": ("checkpoints/", "plan/", "parallel/", "data/", "models/", "observe/", "runtime/", "io/",
                 "config.py", "exits.py"),
    "forecast": ("training/", "plan/", "parallel/", "data/", "models/", "observe/", "io/", "config.py", "exits.py"),
    "evaluation": ("data/", "models/", "observe/", "io/", "config.py", "exits.py"),
    "roles": ("evaluation/", "forecast/", "training/", "checkpoints/", "plan/", "parallel/", "data/", "models/",
              "observe/", "runtime/", "io/", "config.py", "exits.py"),
    "report": ("io/",),  # files.py only, the standard library's: the report runs on any machine
    "bench": ("roles/", "evaluation/", "forecast/", "training/", "checkpoints/", "plan/", "parallel/", "data/",
              "models/", "observe/", "runtime/", "io/", "config.py", "exits.py"),
}
_NAMES = re.compile(r"\b(\w+)/|(?<![/\w])(\w+)\.py\b")  # "data/", "config.py" (not "io/files.py"'s file)


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


def allowed(src: str) -> set[str]:
    """The rooms (room()) folder `src` may import, from MAY_IMPORT."""
    return {name.rstrip("/").removesuffix(".py") for name in MAY_IMPORT[src]}


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
            elif src in ENTRY:
                continue
            elif src not in MAY_IMPORT:
                errors.append(f"{m} -> {d}: {src}/ is not in MAY_IMPORT (add what it may import)")
            elif dst not in allowed(src):
                errors.append(f"{m} imports {d}: {src}/ may import only {', '.join(MAY_IMPORT[src])} (MAY_IMPORT)")
    return errors


def may_import_line(init: Path) -> set[str] | None:
    """The names ("data/", "config.py") in the "May import:" paragraph of a folder's __init__.py docstring;
    None when it has none."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    start = doc.find("May import:")
    if start < 0:
        return None
    paragraph = doc[start:].split("\n\n")[0]
    return {a + "/" if a else b + ".py" for a, b in _NAMES.findall(paragraph)
            if a in MAY_IMPORT or b in GROUND}


def docstring_errors(root: Path = PKG) -> list[str]:
    errors = []
    for folder in sorted(MAY_IMPORT):
        init = root / folder / "__init__.py"
        said = may_import_line(init) if init.is_file() else None
        want = f"May import: {', '.join(MAY_IMPORT[folder])}."
        if said is None:
            errors.append(f"{init}: no 'May import:' line; write {want!r}")
        elif said != set(MAY_IMPORT[folder]):
            errors.append(f"{init}: its 'May import:' line names {sorted(said)}, MAY_IMPORT says {want!r}")
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
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(MAY_IMPORT)


def test_the_allowed_imports_form_no_circle():
    """MAY_IMPORT names only folders and the ground floor, and no folder may import its way back to itself."""
    for src, names in MAY_IMPORT.items():
        assert allowed(src) <= set(MAY_IMPORT) | GROUND, f"MAY_IMPORT[{src!r}] names no folder: {names}"
    graph = {f"dflash_dist.{src}": {f"dflash_dist.{d}" for d in allowed(src) - GROUND} for src in MAY_IMPORT}
    assert cycles(graph) == []


def test_every_folder_may_import_what_its_docstring_says():
    assert docstring_errors() == []


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
    (pkg / "models" / "__init__.py").write_text('"""doc\n\nMay import: config.py only."""\n')  # stale: io/, exits.py
    (pkg / "roles" / "__init__.py").write_text('"""doc\n\nMay import: evaluation/ (tau), forecast/, training/,\n'
                                               'checkpoints/, plan/, parallel/, data/, models/, observe/, runtime/,\n'
                                               'io/ (io/files.py: writes), config.py, exits.py."""\n')
    stale = [e for e in docstring_errors(pkg) if "'May import:' line names" in e]
    assert len(stale) == 1 and "models/__init__.py" in stale[0] and "'May import: io/, config.py, exits.py.'" in stale[0]
    assert sorted(cycles(graph)) == [["dflash_dist.models.a", "dflash_dist.roles.drafter"],
                                     ["dflash_dist.models.b", "dflash_dist.models.c"]]
