"""No test reaches into benchmarks/ (docs/architecture.md): what a benchmark computes and a
test checks lives in the package, so a benchmark stays a thin CLI that a test never loads.

Read with ``ast``, never imported: an import of ``benchmarks``, or a call that loads or runs
code (``spec_from_file_location``, ``runpy``, ``subprocess``, ``exec``, ``sys.path``) whose
arguments name a path under benchmarks/, directly or through a name assigned from one. A
mention in a docstring, a comment or a message is not a reach; nor is reading a benchmark's
text (tests/test_moved.py scans every folder for old module paths)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# a path component "benchmarks" (benchmarks/x.py, REPO / "benchmarks"), or a dotted module
BENCH_PATH = re.compile(r"(?:^|[/\\])benchmarks(?:[/\\.]|$)")
LOADERS = {  # calls that load or run code, by qualified name
    "importlib.util.spec_from_file_location", "importlib.import_module",
    "importlib.machinery.SourceFileLoader", "runpy.run_path", "runpy.run_module",
    "subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
    "subprocess.check_output", "os.system", "os.execv", "os.execvp", "os.execve",
    "sys.path.insert", "sys.path.append", "sys.path.extend", "exec", "eval", "compile",
    "__import__",
}
LOADER_METHODS = {"syspath_prepend"}  # pytest's monkeypatch: on a fixture, any name


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


class _Reaches(ast.NodeVisitor):
    """One source's reaches into benchmarks/: (line, what) for each."""

    def __init__(self, tree: ast.Module) -> None:
        # a local name's qualified one (import x.y as z, from a import b)
        self.aliases: dict[str, str] = {}
        self.tainted = self._tainted(tree)
        self.found: list[tuple[int, str]] = []

    def _tainted(self, tree: ast.Module) -> set[str]:
        """Names assigned, anywhere, from an expression naming a benchmarks path or another
        such name (SCRIPT = REPO / "benchmarks" / "x.py"; PATH = str(SCRIPT))."""
        assigns = [(n.targets if isinstance(n, ast.Assign) else [n.target], n.value)
                   for n in ast.walk(tree)
                   if isinstance(n, ast.Assign | ast.AnnAssign | ast.NamedExpr)
                   and n.value is not None]
        names: set[str] = set()
        grew = True
        while grew:
            grew = False
            for targets, value in assigns:
                if not self._mentions(value, names):
                    continue
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id not in names:
                            names.add(name.id)
                            grew = True
        return names

    @staticmethod
    def _mentions(node: ast.AST, names: set[str]) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                if BENCH_PATH.search(sub.value):
                    return True
            elif isinstance(sub, ast.Name) and sub.id in names:
                return True
        return False

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "benchmarks":
                self.found.append((node.lineno, f"import {alias.name}"))
            self.aliases[(alias.asname or alias.name).split(".")[0]] = (
                alias.name if alias.asname else alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] == "benchmarks":
            self.found.append((node.lineno, f"from {module} import ..."))
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func) or ""
        head, _, rest = name.partition(".")
        qualified = ".".join(filter(None, (self.aliases.get(head, head), rest)))
        loads = qualified in LOADERS or name.rpartition(".")[2] in LOADER_METHODS
        if loads and any(self._mentions(arg, self.tainted)
                         for arg in [*node.args, *(k.value for k in node.keywords)]):
            self.found.append((node.lineno, qualified))
        self.generic_visit(node)


def reaches(source: str) -> list[tuple[int, str]]:
    """Where ``source`` imports, loads or runs something under benchmarks/."""
    tree = ast.parse(source)
    visitor = _Reaches(tree)
    visitor.visit(tree)
    return visitor.found


@pytest.mark.parametrize("source", [
    "import benchmarks.paper_accuracy",
    "from benchmarks.gpu_check import main",
    "from benchmarks import gpu_check as g",
    """\
    import importlib.util
    spec = importlib.util.spec_from_file_location("p", REPO / "benchmarks" / "p.py")
    """,
    """\
    from importlib.util import spec_from_file_location as load
    SCRIPT = REPO / "benchmarks" / "gpu_check.py"
    def f():
        load("gpu_check", SCRIPT)
    """,
    """\
    import subprocess, sys
    SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
    ARGS = [sys.executable, str(SCRIPT)]
    subprocess.run([*ARGS, "--dry-run"], check=True)
    """,
    "import subprocess as sp\nsp.check_output(['bash', 'benchmarks/gpu_check.sh'])",
    "import runpy\nrunpy.run_path(str(REPO / 'benchmarks/paper_region.py'))",
    "import sys\nsys.path.insert(0, str(REPO / 'benchmarks'))",
    "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'benchmarks.bench_runtime'])",
    "def t(monkeypatch):\n    monkeypatch.syspath_prepend(REPO / 'benchmarks')",
])
def test_a_reach_into_benchmarks_is_found(source):
    assert reaches(textwrap.dedent(source)), source


@pytest.mark.parametrize("source", [
    '"""The figures of benchmarks/paper_region.py, computed in the package."""',
    "# benchmarks/gpu_check.py runs this on a GPU\nx = 1",
    "import pytest\npytest.skip('run benchmarks/paper_region.py by hand')",
    """\
    for folder in ("src", "tests", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
    """,
    "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print(1)'])",
    "from stmoe.evaluate import compare as bench\nbench.rotated([1], 0)",
])
def test_a_mention_or_a_read_is_not_a_reach(source):
    assert reaches(textwrap.dedent(source)) == [], source


def test_no_test_imports_loads_or_runs_a_benchmark():
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}: {what}"
                 for path in sorted(TESTS.rglob("*.py"))
                 for line, what in reaches(path.read_text(encoding="utf-8"))]
    assert not offenders, "tests reaching into benchmarks/ (move what they check into the " \
        "package):\n" + "\n".join(offenders)
