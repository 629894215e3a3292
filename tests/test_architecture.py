"""Architecture checks, read from the source with `ast` (nothing is imported):

- the project's own modules import each other without a cycle, and so do its packages (configs, models, ...:
  package A importing package B, and B importing A anywhere, is a cycle between the layers);
- no string constant in tasks/ or flows/ is SQL (SQL lives in stores/);
- the dependency direction of docs/architecture.md holds.

Each checker takes a root folder and returns every offender, so a failure lists them all; the
self-tests at the bottom run the checkers on a tiny synthetic tree to show that each one can fail.
"""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("configs", "envs", "flows", "methods", "models", "stats", "stores", "tasks", "bench", "examples")
INSTALLED = "rsiflow"   # the folders install as rsiflow.<folder> (pyproject.toml package-dir)

# A keyword that starts a statement, then (anywhere later, across lines) one that continues it.
SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b.*\b(FROM|INTO|SET|WHERE)\b", re.DOTALL)

# package -> top-level names (project packages or third-party) that its modules must never reach,
# directly or through the project modules they import.
FORBIDDEN = {
    "methods": {"prefect", "duckdb"},
    "stats": {"prefect", "duckdb", "torch", "tasks", "flows", "stores", "models"},
    "stores": {"torch"},
    "envs": {"tasks", "flows"},
    "models": {"tasks", "flows", "stores"},
}


def project_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/<package> (`__init__.py` is the package)."""
    modules = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every import statement anywhere in the file (module level, functions, classes), as
    (dotted target, line) in line order. `from pkg import name` gives `pkg.name` when that is a project module,
    else `pkg`; relative imports are resolved against `module`'s package."""
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = _folder_name(f"{base}.{alias.name}")
                found.append((target if target in modules else _folder_name(base), node.lineno))
    return sorted([(_folder_name(t), line) for t, line in found], key=lambda f: f[1])


def _folder_name(target: str) -> str:
    """The installed name of a project module (`rsiflow.tasks.train`, pyproject.toml's package-dir) as its
    folder's (`tasks.train`); any other name unchanged."""
    return target.removeprefix(INSTALLED + ".") if target.split(".")[0] == INSTALLED else target


def import_graph(root: Path, packages=PACKAGES) -> dict[str, dict[str, int]]:
    """Project module -> {imported project module: line of the first such import}. An import of a
    name that is not itself a module (`import a.b.c` with c a function) points at its longest module prefix."""
    modules = project_modules(root, packages)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        for target, line in imports(module, path, modules):
            parts = target.split(".")
            for n in range(len(parts), 0, -1):
                if ".".join(parts[:n]) in modules:
                    graph[module].setdefault(".".join(parts[:n]), line)
                    break
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected component that has one
    (Tarjan's algorithm, then a path search inside the component)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
                on_stack.discard(w)
            on_stack.discard(v)
            components.append(component | {v})

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        # breadth-first search for the shortest way back to `start` inside the component
        paths, seen = [[start]], set()
        while paths:
            path = paths.pop(0)
            nxt = sorted(w for w in graph[path[-1]] if w in component)
            if start in nxt:
                cycles.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return sorted(cycles)


def cycle_report(root: Path, packages=PACKAGES) -> list[str]:
    """Each import cycle as `a (line N) -> b (line M) -> a`: the line is where the module before
    the arrow imports the module after it."""
    graph = import_graph(root, packages)
    return [
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[0]}"
        for cycle in find_cycles(graph)
    ]


def package_cycle_report(root: Path, packages=PACKAGES) -> list[str]:
    """Each cycle among the packages (a package imports another when one of its modules does), as
    `a -> b -> a` with, per edge, the first module import that makes it (`a.x (line N) imports b.y`)."""
    graph = import_graph(root, packages)
    edges: dict[str, dict[str, str]] = {}
    for a, targets in sorted(graph.items()):
        for b, line in sorted(targets.items()):
            pa, pb = a.split(".")[0], b.split(".")[0]
            if pa != pb:
                edges.setdefault(pa, {}).setdefault(pb, f"{a} (line {line}) imports {b}")
    nodes = {m.split(".")[0] for m in graph} | {b for bs in edges.values() for b in bs}
    package_graph = {a: {b: 0 for b in edges.get(a, {})} for a in nodes}
    return [" -> ".join(cycle) + ": " + "; ".join(edges[a][b] for a, b in zip(cycle, cycle[1:]))
            for cycle in find_cycles(package_graph)]


def sql_strings(root: Path, packages=("tasks", "flows")) -> list[str]:
    """`file:line: text` for every string constant under root/<package> that matches SQL. An f-string
    is checked as a whole, with `{}` for each interpolated value."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            in_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
            for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
                if isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
                    text = node.value
                else:
                    continue
                if SQL.search(text):
                    snippet = " ".join(text.split())[:80]
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {snippet!r}")
    return found


def layer_violations(root: Path, forbidden=FORBIDDEN, packages=PACKAGES) -> list[str]:
    """`module reaches name via a -> b (file:line)` for each module of a package in `forbidden` that
    imports a forbidden top-level name itself or through the project modules it imports."""
    modules = project_modules(root, packages)
    graph = import_graph(root, packages)
    # module -> {top-level name it imports directly: first line}, project and third-party alike
    direct = {m: {} for m in modules}
    for m, path in modules.items():
        for target, line in imports(m, path, modules):
            direct[m].setdefault(target.split(".")[0], line)
    found = []
    for module in sorted(modules):
        banned = forbidden.get(module.split(".")[0], set())
        if not banned:
            continue
        # breadth-first over the project modules `module` reaches, remembering how
        via, queue = {module: [module]}, [module]
        for m in queue:
            for name in sorted(banned & direct[m].keys()):
                where = f"{modules[m].relative_to(root)}:{direct[m][name]}"
                found.append(f"{module} imports {name} via {' -> '.join(via[m])} ({where})")
            for w in sorted(graph[m]):
                if w not in via:
                    via[w] = via[m] + [w]
                    queue.append(w)
    return found


def _fail_listing(title: str, found: list[str]):
    if found:
        pytest.fail(f"{title} ({len(found)}):\n" + "\n".join(found), pytrace=False)


def test_no_import_cycles():
    _fail_listing("import cycles among the project's modules", cycle_report(REPO))


def test_no_import_cycles_between_packages():
    _fail_listing("import cycles among the project's packages", package_cycle_report(REPO))


def test_no_sql_in_tasks_or_flows():
    _fail_listing("SQL in tasks/ or flows/ (move it into stores/)", sql_strings(REPO))


def test_dependency_direction():
    _fail_listing("imports against the dependency direction", layer_violations(REPO))


# --- the checkers on a synthetic tree ---------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cycle_checker_finds_function_level_and_from_package_cycles(tmp_path):
    _tree(tmp_path, {
        "models/__init__.py": "",
        "models/a.py": "def f():\n    from models import b\n",  # `from pkg import module`
        "models/b.py": "import models.a\n",
        "models/c.py": "from . import c\n",  # a relative self-import
        "models/d.py": "from models.a import f\n",  # imports into a cycle, is not in one
    })
    assert cycle_report(tmp_path) == [
        "models.a (line 2) -> models.b (line 1) -> models.a",
        "models.c (line 1) -> models.c",
    ]


def test_cycle_checker_follows_the_installed_names(tmp_path):
    """The code imports `rsiflow.<folder>.<module>`; the checkers see the folder's module."""
    _tree(tmp_path, {
        "tasks/__init__.py": "", "models/__init__.py": "",
        "tasks/t.py": "from rsiflow.models.m import f\n",
        "models/m.py": "import rsiflow.tasks.t as t\n",
    })
    assert cycle_report(tmp_path) == ["models.m (line 1) -> tasks.t (line 1) -> models.m"]


def test_package_cycle_checker_names_the_imports_that_make_it(tmp_path):
    _tree(tmp_path, {
        "configs/__init__.py": "", "models/__init__.py": "",
        "configs/schema.py": "def check():\n    from rsiflow.models.backend import BACKENDS\n",
        "models/backend.py": "BACKENDS = {}\n",
        "models/launch.py": "from rsiflow.configs.schema import check\n",
    })
    assert cycle_report(tmp_path) == []   # no module cycle ...
    assert package_cycle_report(tmp_path) == [   # ... but the two packages depend on each other
        "configs -> models -> configs: configs.schema (line 2) imports models.backend; "
        "models.launch (line 1) imports configs.schema"]


def test_the_repositorys_import_graph_is_not_empty():
    """A checker that resolves no import passes vacuously: the real graph must hold the imports everyone knows."""
    graph = import_graph(REPO)
    assert {"models.trainer", "configs.schema"} <= set(graph["tasks.train"])
    assert sum(map(len, graph.values())) > 150


def test_cycle_checker_passes_a_package_that_registers_its_modules(tmp_path):
    _tree(tmp_path, {
        "envs/__init__.py": "from envs.one import One\n",
        "envs/one.py": "from envs.base import Env\n",
        "envs/base.py": "Env = object\n",
    })
    assert cycle_report(tmp_path) == []


def test_sql_checker_names_file_and_line(tmp_path):
    _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/t.py": 'def f(t):\n    q = f"SELECT {t}\\n  FROM runs"\n    return "select it from the list"\n',
        "flows/f.py": 'X = 1\nY = "DELETE FROM runs WHERE id = ?"\n',
        "stores/s.py": 'Q = "SELECT * FROM runs"\n',  # stores/ may hold SQL
    })
    assert sql_strings(tmp_path) == [
        "tasks/t.py:2: 'SELECT {} FROM runs'",
        "flows/f.py:2: 'DELETE FROM runs WHERE id = ?'",
    ]


def test_layer_checker_finds_direct_and_indirect_imports(tmp_path):
    _tree(tmp_path, {
        "methods/m.py": "def f():\n    import duckdb.typing\n",
        "methods/n.py": "from stores import s\n",  # reaches duckdb through stores.s
        "stores/__init__.py": "",
        "stores/s.py": "import duckdb\nimport torch\n",
        "envs/e.py": "from tasks.t import step\n",
        "tasks/t.py": "import prefect\n",
        "models/x.py": "import flows\n",
        "flows/__init__.py": "",
    })
    assert layer_violations(tmp_path) == [
        "envs.e imports tasks via envs.e (envs/e.py:1)",
        "methods.m imports duckdb via methods.m (methods/m.py:2)",
        "methods.n imports duckdb via methods.n -> stores.s (stores/s.py:1)",
        "models.x imports flows via models.x (models/x.py:1)",
        "stores.s imports torch via stores.s (stores/s.py:2)",
    ]


def test_ruff_is_clean():
    """The lint the project keeps (pyproject: ruff E, F, I, W, UP, B at 120 columns) holds on the whole tree."""
    import subprocess
    import sys

    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed in this environment (it is in the `test` extra)")
    out = subprocess.run([str(ruff), "check", "--output-format", "concise", str(REPO)], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
