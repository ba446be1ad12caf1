#!/usr/bin/env python3
"""stmoe's import graph, read from the source: the limits of issue 26 and the architecture figure.

Why: the limits (no import cycle, function-level imports included; no module over 350 lines;
at most 8 files directly under src/stmoe) must keep holding while the tree changes, and the
architecture doc's picture must not drift from the code. Both come from one parse: every
``.py`` under src/stmoe is read with ``ast`` and never imported (no torch, no side effects).
Every import statement counts, wherever it is: module top, inside functions, under
``if TYPE_CHECKING:``. Names in strings (a compat table of moved modules, say) do not.

    python scripts/import_graph.py check     # prints what breaks a limit; exit status 1 if any
    python scripts/import_graph.py draw -o docs/figures/architecture.png
"""

from __future__ import annotations

import argparse
import ast
import itertools
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

PACKAGE = "stmoe"
MAX_LINES = 350
MAX_TOP_LEVEL = 8
REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
FIGURE = REPO / "docs" / "figures" / "architecture.png"
TITLE = "stmoe: packages and their imports (drawn by scripts/import_graph.py from the source)"

Graph = dict[str, set[str]]


class Edge(NamedTuple):
    """One import statement's edge, kept with its place so a cycle can be traced to a line."""

    source: str
    target: str
    line: int
    in_function: bool


# ----------------------------------------------------------------------------- the parse


def module_files(src: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module by dotted name (a package by its ``__init__``), so edges can be resolved."""
    out: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    """Collects one module's imports of the package, noting which sit inside a function."""

    def __init__(self, module: str, is_package: bool, known: set[str], package: str) -> None:
        self.module, self.is_package, self.known, self.package = module, is_package, known, package
        self.edges: list[Edge] = []
        self.unresolved: list[tuple[str, int]] = []
        self._depth = 0

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node)
        if base is None:
            return
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself.
            self._add(sub if sub in self.known else base, node.lineno)

    def _base(self, node: ast.ImportFrom) -> str | None:
        """The absolute module a ``from`` import reads from (relative ones resolved)."""
        if not node.level:
            return node.module
        parts = self.module.split(".")
        if not self.is_package:
            parts = parts[:-1]
        up = node.level - 1
        if up >= len(parts):
            return None  # beyond the top: an error at import time, not an edge
        parts = parts[: len(parts) - up]
        return ".".join([*parts, node.module] if node.module else parts)

    def _add(self, name: str, line: int) -> None:
        if name != self.package and not name.startswith(self.package + "."):
            return
        target = name
        while target not in self.known and "." in target:
            target = target.rsplit(".", 1)[0]
        if name not in self.known:
            self.unresolved.append((name, line))
        if target in self.known:
            self.edges.append(Edge(self.module, target, line, self._depth > 0))


class Snapshot(NamedTuple):
    """One read of the tree: every answer about it from the same files, even as they move."""

    graph: Graph
    edges: list[Edge]
    unresolved: list[tuple[str, str, int]]  # (module, imported name that is no module, line)
    lines: dict[str, int]


def snapshot(src: Path, package: str = PACKAGE) -> Snapshot:
    """Reads and parses each module once (one moved away meanwhile is left out)."""
    texts: dict[str, tuple[Path, str]] = {}
    for module, path in module_files(src, package).items():
        try:
            texts[module] = (path, path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
    known = set(texts)
    graph: Graph = {module: set() for module in texts}
    edges: list[Edge] = []
    unresolved: list[tuple[str, str, int]] = []
    for module, (path, text) in texts.items():
        visitor = _Imports(module, path.name == "__init__.py", known, package)
        visitor.visit(ast.parse(text, filename=str(path)))
        edges += visitor.edges
        unresolved += [(module, name, line) for name, line in visitor.unresolved]
    for edge in edges:
        graph[edge.source].add(edge.target)
    # Lines as ``wc -l`` counts them, give or take a final newline.
    lines = {module: len(text.splitlines()) for module, (_, text) in texts.items()}
    return Snapshot(graph, edges, unresolved, lines)


def import_edges(
    src: Path, package: str = PACKAGE
) -> tuple[list[Edge], list[tuple[str, str, int]]]:
    """Every edge with its line, and the imported names that are no module of the tree."""
    snap = snapshot(src, package)
    return snap.edges, snap.unresolved


def module_graph(src: Path, package: str = PACKAGE) -> Graph:
    """Each module of ``src/<package>`` mapped to the package's modules it imports, anywhere."""
    return snapshot(src, package).graph


# ----------------------------------------------------------------------------- the limits


def _components(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's, iterative so deep graphs need no recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def enter(node: str) -> Any:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return iter(sorted(graph.get(node, ())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, enter(root))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    work.append((nxt, enter(nxt)))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    out.append(sorted(component))
    return out


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles: components of more than one module, and modules importing themselves.

    A package importing its own submodule is an edge ``pkg -> pkg.sub``, no loop; it is part
    of a cycle only when the submodule (or something it imports) imports the package back.
    """
    found = [c for c in _components(graph) if len(c) > 1]
    found += [[m] for m in graph if m in graph[m]]
    return sorted(found)


def cycle_path(graph: Mapping[str, Iterable[str]], members: list[str]) -> list[str]:
    """One shortest loop through the first member, to show how a cycle closes."""
    start, inside = members[0], set(members)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if nxt in inside and nxt not in previous and nxt != start:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start]


def line_counts(src: Path, package: str = PACKAGE) -> dict[str, int]:
    """Lines of each module."""
    return snapshot(src, package).lines


def _over(lines: Mapping[str, int], limit: int) -> list[tuple[str, int]]:
    return sorted(((m, n) for m, n in lines.items() if n > limit), key=lambda i: (-i[1], i[0]))


def long_modules(
    src: Path, limit: int = MAX_LINES, package: str = PACKAGE
) -> list[tuple[str, int]]:
    """Modules over ``limit`` lines, longest first."""
    return _over(line_counts(src, package), limit)


def top_level_files(src: Path, package: str = PACKAGE) -> list[str]:
    """The ``.py`` files directly under ``src/<package>`` (``__init__`` and ``__main__`` too)."""
    return sorted(p.name for p in (src / package).glob("*.py"))


def check(src: Path = SRC, package: str = PACKAGE, out: Any = None) -> int:
    """Prints each limit's state; 1 if any is broken, so CI and the tests share one verdict."""
    out = out or sys.stdout
    snap = snapshot(src, package)
    graph, edges, unresolved = snap.graph, snap.edges, snap.unresolved
    found, long = cycles(graph), _over(snap.lines, MAX_LINES)
    top = top_level_files(src, package)
    print(f"modules: {len(graph)}, import edges: {sum(map(len, graph.values()))}", file=out)
    print(f"import cycles: {len(found)}", file=out)
    for members in found:
        path = cycle_path(graph, members)
        size = f"  ({len(members)} modules)" if len(members) > 2 else ""
        print(f"  {' -> '.join(path)}{size}", file=out)
        for a, b in itertools.pairwise(path):
            where = next(e for e in edges if e.source == a and e.target == b)
            kind = "in a function" if where.in_function else "module level"
            print(f"      {a}:{where.line} imports {b} ({kind})", file=out)
    print(f"modules over {MAX_LINES} lines: {len(long)}", file=out)
    for module, lines in long:
        print(f"  {module}: {lines} lines", file=out)
    print(f"files directly under src/{package}: {len(top)} (at most {MAX_TOP_LEVEL})", file=out)
    if len(top) > MAX_TOP_LEVEL:
        print(f"  {', '.join(top)}", file=out)
    if unresolved:
        print(
            f"imports of {package} names that are no module here (not a limit): {len(unresolved)}",
            file=out,
        )
        for module, name, line in unresolved:
            print(f"  {module}:{line} imports {name}", file=out)
    broken = bool(found) or bool(long) or len(top) > MAX_TOP_LEVEL
    print("FAIL" if broken else "OK", file=out)
    return int(broken)


# ----------------------------------------------------------------------------- the figure


def group_of(module: str) -> str:
    """A module's box: its subpackage directly under the root, or itself if a top-level file."""
    return ".".join(module.split(".")[:2])


def group_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, dict[str, int]]:
    """Group-to-group edges weighted by the module edges behind them (inside a group: none)."""
    out: dict[str, dict[str, int]] = {group_of(m): {} for m in graph}
    for source, targets in graph.items():
        for target in targets:
            a, b = group_of(source), group_of(target)
            if a != b:
                out[a][b] = out[a].get(b, 0) + 1
    return out


def _order(groups: Mapping[str, Mapping[str, int]]) -> list[str]:
    """An order with importers before what they import, few (light) edges against it (Eades)."""
    remaining = set(groups)
    head: list[str] = []
    tail: list[str] = []

    def weight(node: str, outgoing: bool) -> int:
        if outgoing:
            return sum(w for t, w in groups[node].items() if t in remaining)
        return sum(groups[s].get(node, 0) for s in remaining)

    while remaining:
        sinks = sorted(n for n in remaining if not weight(n, True))
        if sinks:
            tail, remaining = sinks + tail, remaining - set(sinks)
            continue
        sources = sorted(n for n in remaining if not weight(n, False))
        if sources:
            head, remaining = head + sources, remaining - set(sources)
            continue
        best = max(sorted(remaining), key=lambda n: weight(n, True) - weight(n, False))
        head.append(best)
        remaining.remove(best)
    return head + tail


def layers(groups: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Longest path to the bottom (no dependencies: layer 0), so every arrow points down.

    Edges closing a cycle are left out of the count (they are drawn pointing up, in red).
    """
    order = _order(groups)
    rank = {n: i for i, n in enumerate(order)}
    layer: dict[str, int] = {}
    for node in reversed(order):
        below = [layer[t] for t in groups[node] if rank[t] > rank[node]]
        layer[node] = 1 + max(below) if below else 0
    return layer


def _isotonic(targets: list[float], gaps: list[float]) -> list[float]:
    """Closest positions to ``targets`` keeping neighbours ``gaps`` apart (pool adjacent)."""
    offsets = [0.0]
    for gap in gaps:
        offsets.append(offsets[-1] + gap)
    blocks: list[list[float]] = []  # [mean, count]
    for t, c in zip(targets, offsets, strict=True):
        blocks.append([t - c, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, n2 = blocks.pop()
            v1, n1 = blocks.pop()
            blocks.append([(v1 * n1 + v2 * n2) / (n1 + n2), n1 + n2])
    values = [v for v, n in blocks for _ in range(int(n))]
    return [v + c for v, c in zip(values, offsets, strict=True)]


class _Layout(NamedTuple):
    """Where each box and each bend of a long arrow goes (x in inches on the figure)."""

    rows: list[list[str]]  # bottom row first; bends (dummy nodes) start with "~"
    x: dict[str, float]
    width: dict[str, float]
    chains: dict[tuple[str, str], list[str]]  # edge -> its nodes, upper end first


def _chains(
    groups: Mapping[str, Mapping[str, int]], layer: Mapping[str, int]
) -> dict[tuple[str, str], list[str]]:
    """Each edge as a chain of nodes one row apart; a source's long edges share their bends.

    Shared bends make one trunk per importer that branches where its targets sit, instead
    of one line per edge across the whole figure.
    """
    chains: dict[tuple[str, str], list[str]] = {}
    for source in sorted(groups):
        for target in sorted(groups[source]):
            down = layer[source] > layer[target]
            hi, lo = (source, target) if down else (target, source)
            trunk = f"~{source}" if down else f"~{source}>{target}"
            bends = [f"{trunk}@{k}" for k in range(layer[hi] - 1, layer[lo], -1)]
            chains[(source, target)] = [hi, *bends, lo]
    return chains


def _crossings(rows: list[list[str]], down: Mapping[str, Mapping[str, float]]) -> float:
    """Weighted crossings of the links between neighbouring rows (what ordering minimises)."""
    total = 0.0
    for k in range(1, len(rows)):
        pos_lo = {n: i for i, n in enumerate(rows[k - 1])}
        links = [(i, pos_lo[b], w) for i, a in enumerate(rows[k]) for b, w in down[a].items()]
        for j, (a1, b1, w1) in enumerate(links):
            for a2, b2, w2 in links[j + 1 :]:
                if (a1 - a2) * (b1 - b2) < 0:
                    total += w1 * w2
    return total


def _layout(
    groups: Mapping[str, Mapping[str, int]],
    layer: Mapping[str, int],
    width: Mapping[str, float],
    gaps: tuple[float, float] = (0.3, 0.07),
) -> _Layout:
    """Sugiyama in short: bends for long edges, barycentre ordering, then straightening.

    ``gaps``: the space between two boxes, and beside a bend.
    """
    chains = _chains(groups, layer)
    height = max(layer.values(), default=0) + 1
    rows: list[list[str]] = [[] for _ in range(height)]
    for node in sorted(groups):
        rows[layer[node]].append(node)
    up: dict[str, dict[str, float]] = {}
    down: dict[str, dict[str, float]] = {}
    widths = dict(width)
    for (source, target), chain in sorted(chains.items()):
        for node in chain:
            if node not in up:
                up[node], down[node] = {}, {}
                if node.startswith("~"):
                    rows[int(node.rsplit("@", 1)[1])].append(node)
                    widths[node] = 0.0
        for a, b in itertools.pairwise(chain):
            weight = float(groups[source][target])
            down[a][b] = down[a].get(b, 0.0) + weight
            up[b][a] = up[b].get(a, 0.0) + weight

    def sort_row(k: int, side: Mapping[str, Mapping[str, float]], other: int) -> None:
        pos = {n: i for i, n in enumerate(rows[other])}
        spread = max(len(rows[other]), 1) / max(len(rows[k]), 1)

        def centre(item: tuple[int, str]) -> tuple[float, int]:
            i, node = item
            links = side[node]
            if not links:
                return i * spread, i
            return sum(pos[n] * w for n, w in links.items()) / sum(links.values()), i

        rows[k] = [n for _, n in sorted(enumerate(rows[k]), key=centre)]

    best, best_rows = _crossings(rows, down), [list(r) for r in rows]
    for sweep in range(24):
        if sweep % 2 == 0:
            for k in range(height - 2, -1, -1):
                sort_row(k, up, k + 1)
        else:
            for k in range(1, height):
                sort_row(k, down, k - 1)
        score = _crossings(rows, down)
        if score < best:
            best, best_rows = score, [list(r) for r in rows]
    rows = best_rows

    def gap(a: str, b: str) -> float:
        space = gaps[1] if a.startswith("~") or b.startswith("~") else gaps[0]
        return (widths[a] + widths[b]) / 2 + space

    x: dict[str, float] = {}
    for row in rows:
        packed = _isotonic([0.0] * len(row), [gap(a, b) for a, b in itertools.pairwise(row)])
        x.update(zip(row, packed, strict=True))
    for sweep in range(60):
        for k in range(height) if sweep % 2 else range(height - 1, -1, -1):
            targets = []
            for node in rows[k]:
                # Bends pull harder on each other, so that trunks run straight.
                links = {
                    n: w * (4.0 if n.startswith("~") and node.startswith("~") else 1.0)
                    for n, w in (up[node] | down[node]).items()
                }
                total = sum(links.values())
                targets.append(
                    sum(x[n] * w for n, w in links.items()) / total if total else x[node]
                )
            steps = [gap(a, b) for a, b in itertools.pairwise(rows[k])]
            x.update(zip(rows[k], _isotonic(targets, steps), strict=True))
    return _Layout(rows, x, widths, chains)


def _levels(
    spans: Mapping[tuple[str, str, bool], tuple[float, float]], row: Mapping[Any, int]
) -> dict[tuple[str, str, bool], float]:
    """Each link's height in its gap between rows (0: bottom, 1: top), so that long links run
    level at heights of their own instead of on one line.

    Links to the right go low to high by where they start, links to the left above them,
    from the right: of two parallel links neither then crosses the other's level part.
    """
    out: dict[tuple[str, str, bool], float] = {}
    for k in set(row.values()):
        mine = [link for link in spans if row[link] == k]
        right = sorted((n for n in mine if spans[n][1] >= spans[n][0]), key=lambda n: spans[n])
        left = sorted((n for n in mine if spans[n][1] < spans[n][0]), key=lambda n: spans[n])
        ordered = right + left[::-1]
        for i, link in enumerate(ordered):
            out[link] = 0.5 if len(ordered) == 1 else 0.22 + 0.56 * i / (len(ordered) - 1)
    return out


class _Style(NamedTuple):
    """Sizes chosen to fit: font, whether the counts get a line of their own, box height."""

    size: float
    two_lines: bool
    box_h: float


def _label(group: str, src: Path, package: str, members: list[str], lines: int) -> tuple[str, str]:
    """A box's name (``trace/`` a subpackage, ``errors.py`` a module) and its counts."""
    name = group.split(".", 1)[1] if "." in group else group
    counted = f"{lines:,} line{'s' * (lines != 1)}"
    if (src / package / name).is_dir():
        n = len(members)
        return f"{name}/", f"{n} module{'s' * (n != 1)} · {counted}"
    if group == package:
        return f"{package}/__init__.py", counted
    return f"{name}.py", counted


# No red among them: red means a cycle.
_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
_PALETTE += ["#17becf", "#ff7f0e", "#393b79", "#637939", "#8c6d31", "#7b4173", "#3182bd"]
_BOX = {"package": "#d6e6f5", "module": "#ececec", "root": "#fbe3c0"}
_EDGE = "#44617d"
_RED = "#d62728"


class _Picture:
    """One figure being drawn: the graph's groups, then the fitted layout, then the artists."""

    W, H, DPI = 12.0, 8.0, 110
    BOTTOM, TOP = 0.45, 8.0 - 0.85  # inches kept free for the legend and the titles

    def __init__(self, src: Path, package: str) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.package = package
        snap = snapshot(src, package)
        graph, n_lines = snap.graph, snap.lines
        self.groups = group_graph(graph)
        self.layer = layers(self.groups)
        self.in_cycle = {group_of(m) for c in cycles(graph) for m in c}
        self.red = {
            (a, b)
            for c in _components(self.groups)
            if len(c) > 1
            for a in c
            for b in self.groups[a]
            if b in c
        }
        members: dict[str, list[str]] = {}
        for module in graph:
            members.setdefault(group_of(module), []).append(module)
        self.labels = {
            g: _label(g, src, package, members[g], sum(n_lines[m] for m in members[g]))
            for g in self.groups
        }
        self.top_weight = max((w for t in self.groups.values() for w in t.values()), default=1)
        self.fig = Figure(figsize=(self.W, self.H), dpi=self.DPI)
        self.renderer = FigureCanvasAgg(self.fig).get_renderer()

    def text_width(self, text: str, size: float, bold: bool = False) -> float:
        """Inches the text takes, measured by the renderer that will draw it."""
        probe = self.fig.text(0, 0, text, fontsize=size, fontweight="bold" if bold else "normal")
        inches = float(probe.get_window_extent(self.renderer).width) / self.DPI
        probe.remove()
        return inches

    def fit(self) -> None:
        """Label form, font and spacing: as large as 12 x 8 inches allow, nothing overlapping."""
        n_rows = max(self.layer.values(), default=0) + 1
        style = _Style(10.0, True, 0.5)
        if (self.TOP - self.BOTTOM - style.box_h) / max(n_rows - 1, 1) - style.box_h < 0.4:
            style = _Style(
                9.5, False, 0.3
            )  # rows too close for two lines: name and counts side by side
        avail = self.W - 0.5
        links = {g: 0 for g in self.groups}  # a box is wide enough for its arrows' ports
        for chain in _chains(self.groups, self.layer).values():
            links[chain[0]] += 1
            links[chain[-1]] += 1
        while True:
            widths = {}
            for g, (name, stats) in self.labels.items():
                a, b = (
                    self.text_width(name, style.size, True),
                    self.text_width(stats, style.size - 1.5),
                )
                text = max(a, b) if style.two_lines else a + 0.12 + b
                widths[g] = max(text + 0.24, 0.13 * links[g])
            placed = _layout(self.groups, self.layer, widths)
            if self._span(placed) <= avail or style.size <= 7.5:
                break
            style = style._replace(size=style.size - 0.5)
        # Where there is room, spread the rows: lines far apart are easier to follow.
        for factor in (1.5, 2.0, 3.0):
            wider = _layout(self.groups, self.layer, widths, (0.3 * factor, 0.07 * factor))
            if self._span(wider) > 0.9 * avail:
                break
            placed = wider
        self.style, self.placed = style, placed
        left = min((placed.x[n] - placed.width[n] / 2 for n in placed.x), default=0.0)
        # Should it still not fit, the axes widen (boxes keep their text, the picture scales).
        self.x_span = max(self.W, self._span(placed) + 0.5)
        self.x = {n: v - left + (self.x_span - self._span(placed)) / 2 for n, v in placed.x.items()}
        # Gaps between rows grow with the links crossing them (the busy ones get more room).
        crossing = [0] * n_rows  # crossing[k]: links between row k and the row below
        for chain in placed.chains.values():
            for a in chain[:-1]:
                crossing[self.layer_of(a)] += 1
        share = [1.0 + crossing[k] for k in range(1, n_rows)]
        room = self.TOP - self.BOTTOM - n_rows * style.box_h
        least = min(0.25, room / max(n_rows - 1, 1))  # then the rest by the links crossing
        gaps = [min(least + (room - least * len(share)) * w / sum(share), 1.2) for w in share]
        centre = [self.BOTTOM + style.box_h / 2]
        for gap in gaps:
            centre.append(centre[-1] + style.box_h + gap)
        lift = (self.TOP - self.BOTTOM - (centre[-1] - centre[0] + style.box_h)) / 2
        self.y = {n: centre[k] + lift for k, row in enumerate(placed.rows) for n in row}

    @staticmethod
    def _span(placed: _Layout) -> float:
        left = min((placed.x[n] - placed.width[n] / 2 for n in placed.x), default=0.0)
        right = max((placed.x[n] + placed.width[n] / 2 for n in placed.x), default=0.0)
        return right - left

    def line_width(self, weight: float) -> float:
        """Width by the module pairs behind an arrow (square root: one pair stays visible)."""
        return 0.8 + 3.2 * math.sqrt(weight / self.top_weight)

    def _ports(self) -> dict[tuple[str, str, str, bool], float]:
        """Where links leave and reach boxes: spread along the edge, ordered by where they lead.

        A link is (side, upper node, lower node, upward); the edges of one importer going down
        share their first link (one trunk); an upward edge (closing a cycle) has its own.
        """
        ends: dict[str, set[tuple[str, str, bool]]] = {}
        for (source, target), chain in self.placed.chains.items():
            up = self.layer[source] < self.layer[target]
            ends.setdefault(chain[0], set()).add((chain[0], chain[1], up))
            ends.setdefault(chain[-1], set()).add((chain[-2], chain[-1], up))
        out: dict[tuple[str, str, str, bool], float] = {}
        for node, links in ends.items():
            for side, far in (("bottom", 1), ("top", 0)):
                mine = sorted((self.x[k[far]], k[2], k) for k in links if k[1 - far] == node)
                half = self.placed.width[node] * 0.44
                for i, (_, _, link) in enumerate(mine):
                    frac = 0.0 if len(mine) == 1 else 2 * i / (len(mine) - 1) - 1
                    out[(side, *link)] = self.x[node] + frac * half
        return out

    def arrows(self, ax: Any) -> None:
        """Each edge along its chain: S-curves between rows, straight down through a bend."""
        from matplotlib.patches import FancyArrowPatch
        from matplotlib.path import Path as MplPath

        ports, half_h, x, y = self._ports(), self.style.box_h / 2, self.x, self.y
        importers = sorted(
            (g for g, t in self.groups.items() if t), key=lambda g: (-self.layer[g], g)
        )
        colour = {g: _PALETTE[i % len(_PALETTE)] for i, g in enumerate(importers)}
        spans = {
            (a, b, up): (
                x[a] if a.startswith("~") else ports[("bottom", a, b, up)],
                x[b] if b.startswith("~") else ports[("top", a, b, up)],
            )
            for (s, t), chain in self.placed.chains.items()
            for up in [self.layer[s] < self.layer[t]]
            for a, b in itertools.pairwise(chain)
        }
        level = _levels(spans, {link: self.layer_of(link[1]) for link in spans})
        for (source, target), chain in sorted(self.placed.chains.items()):
            up = self.layer[source] < self.layer[target]
            verts = [(spans[(chain[0], chain[1], up)][0], y[chain[0]] - half_h)]
            codes = [MplPath.MOVETO]
            for a, b in itertools.pairwise(chain):
                start_x, end_x = spans[(a, b, up)]
                start_y, end_y = verts[-1][1], y[b] + half_h
                # The nearly level part of the S sits at the link's own height in the gap.
                turn = end_y + level[(a, b, up)] * (start_y - end_y)
                verts += [(start_x, turn), (end_x, turn), (end_x, end_y)]
                codes += [MplPath.CURVE4] * 3
                if b.startswith("~"):  # straight down through the row, in the room kept for it
                    verts.append((end_x, y[b] - half_h))
                    codes.append(MplPath.LINETO)
            if up:  # reversed, a vertex takes the code of the one after it: Beziers stay whole
                verts, codes = verts[::-1], [MplPath.MOVETO, *codes[1:][::-1]]
            red = (source, target) in self.red
            lw = self.line_width(self.groups[source][target])
            ax.add_patch(
                FancyArrowPatch(
                    path=MplPath(verts, codes),
                    arrowstyle=f"-|>,head_length={0.3 + 0.05 * lw:.2f},"
                    f"head_width={0.15 + 0.035 * lw:.2f}",
                    mutation_scale=14,
                    linewidth=lw,
                    color=_RED if red else colour[source],
                    alpha=0.95 if red else 0.7,
                    zorder=5 if red else 4,
                )
            )

    def layer_of(self, node: str) -> int:
        """The row of a box or a bend."""
        return int(node.rsplit("@", 1)[1]) if node.startswith("~") else self.layer[node]

    def boxes(self, ax: Any) -> None:
        """One box per group above the arrows; red-edged if modules inside it form a cycle."""
        from matplotlib.patches import FancyBboxPatch

        size, small, h = self.style.size, self.style.size - 1.5, self.style.box_h
        for group, (name, stats) in self.labels.items():
            kind = (
                "package" if name.endswith("/") else "root" if group == self.package else "module"
            )
            x, y, w = self.x[group], self.y[group], self.placed.width[group]
            ax.add_patch(
                FancyBboxPatch(
                    (x - w / 2, y - h / 2),
                    w,
                    h,
                    boxstyle="round,pad=0,rounding_size=0.06",
                    facecolor=_BOX[kind],
                    edgecolor=_RED if group in self.in_cycle else _EDGE,
                    linewidth=2.2 if group in self.in_cycle else 1.0,
                    zorder=6,
                )
            )
            if self.style.two_lines:
                spots = [(x, y + h * 0.17, "center"), (x, y - h * 0.2, "center")]
            else:
                a, b = self.text_width(name, size, True), self.text_width(stats, small)
                start = x - (a + 0.12 + b) / 2
                spots = [(start, y, "left"), (start + a + 0.12, y, "left")]
            for (tx, ty, ha), text, bold in zip(spots, (name, stats), (True, False), strict=True):
                ax.text(
                    tx,
                    ty,
                    text,
                    ha=ha,
                    va="center_baseline",
                    fontsize=size if bold else small,
                    fontweight="bold" if bold else "normal",
                    color="#111111" if bold else "#444444",
                    zorder=7,
                )

    def legend(self, ax: Any) -> None:
        """What boxes, widths and red mean, in one row under the picture."""
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        samples = sorted({1, max(1, round(self.top_weight / 4)), self.top_weight})
        handles: list[Any] = [
            Patch(facecolor=_BOX["package"], edgecolor=_EDGE, label="subpackage"),
            Patch(facecolor=_BOX["module"], edgecolor=_EDGE, label=f"module in {self.package}/"),
            Patch(facecolor=_BOX["root"], edgecolor=_EDGE, label=f"{self.package}/__init__.py"),
        ]
        handles += [
            Line2D(
                [],
                [],
                color="#5b7590",
                lw=self.line_width(s),
                label=f"{s} module pair" + "s" * (s != 1),
            )
            for s in samples
        ]
        handles.append(Line2D([], [], color=_RED, lw=2, label="import cycle"))
        ax.legend(
            handles=handles,
            loc="lower center",
            ncol=len(handles),
            frameon=False,
            fontsize=8.5,
            bbox_to_anchor=(0.5, 0.0),
            handlelength=2.4,
        )

    def save(self, output: Path) -> Path:
        """Fit, draw everything, write the PNG."""
        self.fit()
        ax = self.fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, self.x_span)
        ax.set_ylim(0, self.H)
        ax.set_axis_off()
        self.fig.text(
            0.5, 1 - 0.32 / self.H, TITLE, ha="center", va="center", fontsize=13, weight="bold"
        )
        self.fig.text(
            0.5,
            1 - 0.62 / self.H,
            "A \u2192 B: a module in A imports one in B (at module level or in a function). "
            "Width: how many module pairs; colour: the importer; red: an import cycle.",
            ha="center",
            va="center",
            fontsize=9,
            color="#333333",
        )
        self.arrows(ax)
        self.boxes(ax)
        self.legend(ax)
        output.parent.mkdir(parents=True, exist_ok=True)
        self.fig.savefig(output, dpi=self.DPI)
        return output


def draw(src: Path = SRC, output: Path = FIGURE, package: str = PACKAGE) -> Path:
    """The architecture figure: one box per group, one arrow per group-to-group import."""
    return _Picture(src, package).save(output)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``check`` for the limits, ``draw`` for the figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--src", type=Path, default=SRC, help="the folder holding the package")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", parents=[common], help="cycles, long modules, top-level files")
    drawing = sub.add_parser("draw", parents=[common], help="write the architecture figure")
    drawing.add_argument("-o", "--output", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.src)
    print(draw(args.src, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
