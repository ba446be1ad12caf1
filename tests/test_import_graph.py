"""scripts/import_graph.py: the parse, the cycle search and the figure on small fabricated
trees (hand-built expectations), and issue 26's limits on the real tree."""

from __future__ import annotations

import importlib.util
import io
import itertools
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "import_graph.py"
PNG = b"\x89PNG\r\n\x1a\n"


def _load() -> ModuleType:
    """The script by its path: scripts/ is no package, and sys.path stays as it is."""
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ig = _load()


def _tree(root: Path, files: dict[str, str]) -> Path:
    """Writes ``files`` (paths under src/stmoe) and returns the src folder."""
    src = root / "src"
    for name, text in files.items():
        path = src / "stmoe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return src


# Every kind of edge once; no cycle.
EDGES = {
    "__init__.py": "from stmoe.errors import E\n",
    "errors.py": "class E(Exception):\n    pass\n",
    "a/__init__.py": "from . import x\n",
    "a/x.py": """\
        import os
        import stmoe.errors

        NAME = "stmoe.b.y"  # a string, no import


        def f():
            from stmoe.b import y

            return y, os
        """,
    "a/z.py": "from .x import f\nfrom ..b import helper\n",
    "b/__init__.py": "helper = 1\n",
    "b/y.py": "import numpy\nfrom stmoe import errors, E\n",
    "c/__init__.py": "",
    "c/deep/__init__.py": "",
    "c/deep/w.py": """\
        class K:
            def m(self):
                from ... import errors
                from ...a.x import f

                return errors, f
        """,
}


def test_module_graph_finds_top_level_function_level_relative_and_submodule_edges(
    tmp_path: Path,
) -> None:
    src = _tree(tmp_path, EDGES)
    assert ig.module_graph(src) == {
        "stmoe": {"stmoe.errors"},
        "stmoe.errors": set(),
        "stmoe.a": {"stmoe.a.x"},  # relative: `from . import x`, x a submodule
        "stmoe.a.x": {"stmoe.errors", "stmoe.b.y"},  # top level; in a function, submodule
        "stmoe.a.z": {"stmoe.a.x", "stmoe.b"},  # relative; helper is no module: the package
        "stmoe.b": set(),
        "stmoe.b.y": {"stmoe.errors", "stmoe"},  # errors a submodule, E a name of stmoe
        "stmoe.c": set(),
        "stmoe.c.deep": set(),
        "stmoe.c.deep.w": {"stmoe.errors", "stmoe.a.x"},  # three dots, in a method
    }
    where = {(e.source, e.target): (e.line, e.in_function) for e in ig.import_edges(src)[0]}
    assert where[("stmoe.a.x", "stmoe.errors")] == (2, False)
    assert where[("stmoe.a.x", "stmoe.b.y")] == (8, True)
    assert where[("stmoe.c.deep.w", "stmoe.errors")] == (3, True)
    assert ig.cycles(ig.module_graph(src)) == []


def test_an_import_of_a_module_not_in_the_tree_goes_to_its_nearest_package(
    tmp_path: Path,
) -> None:
    src = _tree(tmp_path, {"__init__.py": "", "a/__init__.py": "", "b.py": "import stmoe.a.gone\n"})
    assert ig.module_graph(src)["stmoe.b"] == {"stmoe.a"}
    assert ig.import_edges(src)[1] == [("stmoe.b", "stmoe.a.gone", 1)]


def test_cycles_finds_a_two_cycle_made_by_a_function_level_import(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "p.py": "from stmoe.q import g\n",
            "q.py": "def g():\n    from stmoe import p\n    return p\n",
            "r.py": "import stmoe.p\n",
        },
    )
    graph = ig.module_graph(src)
    assert graph == {"stmoe": set(), "stmoe.p": {"stmoe.q"}, "stmoe.q": {"stmoe.p"},
                     "stmoe.r": {"stmoe.p"}}  # fmt: skip
    assert ig.cycles(graph) == [["stmoe.p", "stmoe.q"]]
    assert ig.cycle_path(graph, ["stmoe.p", "stmoe.q"]) == ["stmoe.p", "stmoe.q", "stmoe.p"]
    out = io.StringIO()
    assert ig.check(src, out=out) == 1
    assert "stmoe.q:2 imports stmoe.p (in a function)" in out.getvalue()


def test_a_package_importing_its_submodule_is_a_cycle_only_if_imported_back(
    tmp_path: Path,
) -> None:
    one_way = _tree(tmp_path / "one", {"__init__.py": "", "a/__init__.py": "from .b import t\n",
                                       "a/b.py": "t = 1\n"})  # fmt: skip
    assert ig.cycles(ig.module_graph(one_way)) == []
    both_ways = _tree(tmp_path / "two", {"__init__.py": "", "a/__init__.py": "from .b import t\n",
                                         "a/b.py": "import stmoe.a\nt = 1\n"})  # fmt: skip
    assert ig.cycles(ig.module_graph(both_ways)) == [["stmoe.a", "stmoe.a.b"]]


def test_cycles_on_hand_built_graphs() -> None:
    assert ig.cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert ig.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert ig.cycles({"a": {"a"}, "b": set()}) == [["a"]]  # a module importing itself
    assert ig.cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_long_modules_and_top_level_files(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "ok.py": "x = 1\n" * 350,
            "long.py": "x = 1\n" * 351,
            "sub/__init__.py": "",
            "sub/longer.py": "x = 1\n" * 400,
            "py.typed": "",
        },
    )
    assert ig.long_modules(src) == [("stmoe.sub.longer", 400), ("stmoe.long", 351)]
    assert ig.long_modules(src, limit=400) == []
    assert ig.top_level_files(src) == ["__init__.py", "long.py", "ok.py"]


def test_check_passes_on_a_tree_within_the_limits(tmp_path: Path) -> None:
    src = _tree(tmp_path, EDGES)
    out = io.StringIO()
    assert ig.check(src, out=out) == 0
    assert out.getvalue().splitlines()[-1] == "OK"


def test_layers_point_every_arrow_down_except_those_closing_a_cycle() -> None:
    groups = {"cli": {"core": 2, "errors": 1}, "core": {"errors": 3}, "errors": {}, "x": {}}
    assert ig.layers(groups) == {"cli": 2, "core": 1, "errors": 0, "x": 0}
    cyclic = {"a": {"b": 1}, "b": {"a": 5, "c": 1}, "c": {}}
    layer = ig.layers(cyclic)
    up = [(s, t) for s, ts in cyclic.items() for t in ts if layer[s] <= layer[t]]
    assert up == [("a", "b")]  # the lighter edge of the cycle is the one drawn upwards


@pytest.mark.parametrize(
    "files",
    [
        EDGES,
        {  # a cycle between groups (drawn red, one arrow up) and a long edge with bends
            "__init__.py": "from stmoe.a import x\n",
            "a/__init__.py": "from .x import f\n",
            "a/x.py": "def f():\n    from stmoe.b import y\n",
            "b/__init__.py": "",
            "b/y.py": "from stmoe import errors\ndef g():\n    import stmoe.a.x\n",
            "errors.py": "",
            "top.py": "import stmoe.errors\nimport stmoe.a\n",
        },
    ],
    ids=["acyclic", "cycle"],
)
def test_draw_writes_a_png(tmp_path: Path, files: dict[str, str]) -> None:
    src = _tree(tmp_path, files)
    out = tmp_path / "figures" / "architecture.png"
    assert ig.main(["draw", "--src", str(src), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG


def test_the_figure_of_the_real_tree_has_no_overlapping_boxes() -> None:
    picture = ig._Picture(ig.SRC, ig.PACKAGE)
    picture.fit()
    for row in picture.placed.rows:
        spans = sorted(
            (picture.x[n] - picture.placed.width[n] / 2, picture.x[n] + picture.placed.width[n] / 2)
            for n in row
        )
        for (_, right), (left, _) in itertools.pairwise(spans):
            assert right <= left + 1e-9
    ys = sorted({picture.y[row[0]] for row in picture.placed.rows if row})
    assert all(b - a > picture.style.box_h for a, b in itertools.pairwise(ys))


# The real tree: issue 26's limits.


def test_real_tree_has_no_import_cycle() -> None:
    graph = ig.module_graph(ig.SRC)
    found = [" -> ".join(ig.cycle_path(graph, c)) for c in ig.cycles(graph)]
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_real_tree_has_no_module_over_350_lines() -> None:
    assert ig.long_modules(ig.SRC, limit=350) == []


def test_real_tree_has_at_most_8_files_directly_under_src_stmoe() -> None:
    top = ig.top_level_files(ig.SRC)
    assert len(top) <= 8, f"{len(top)} files: {', '.join(top)}"
