"""The package's shape, checked: no import circle between mlxbatch modules and no module over 400 lines.

Import-linter's contracts (pyproject.toml) hold the layers; this holds what they do not: a circle inside one layer
(lazy imports count: they are circles a reader meets too) and the size a module may grow to before it is split by
concept.
"""

from __future__ import annotations

from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parents[1] / "mlxbatch"
MAX_LINES = 400


def test_no_import_circle():
    graph = grimp.build_graph("mlxbatch")
    circles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back:
                circles.append(" -> ".join([module, *back]))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_module_over_the_size_limit():
    big = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concept): {big}"
