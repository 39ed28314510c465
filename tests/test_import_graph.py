"""The module graph of pydtnn: no import cycles, and no arrow from a subpackage up to the command line.

Every `import` and `from ... import` of a pydtnn module is an arrow, at module level or inside a
function (a function-level import still ties the two modules together), with relative imports
resolved and `from package import module` pointing at the module. Importing a package's __init__ is an
arrow to the package; a submodule may do it as long as no cycle follows.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pydtnn"
# the command-line layer: the top of the house, which nothing inside a subpackage may import
ENTRY_MODULES = frozenset({"pydtnn.cli", "pydtnn.run", "pydtnn.preflight", "pydtnn.report", "pydtnn.resume",
                           "pydtnn.export", "pydtnn.plot"})
KNOWN = frozenset()  # cycles still to break, each a frozenset of its modules: none


def module_name(root, path):
    """'pydtnn.backends.cpu.isa' for root/backends/cpu/isa.py, 'pydtnn.backends' for its __init__.py."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root):
    """{module name: path} of every .py file of the package at root."""
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def _known(name, known):
    """The module `name` loads, or its nearest enclosing one that exists (a.b.function -> a.b); None outside."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name, path, known):
    """The modules of `known` that the module `name` (file `path`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # `from package import module` is an arrow to the module
                full = f"{source}.{alias.name}"
                found.add(full if full in known else _known(source, known))
    found.discard(None)
    found.discard(name)
    return found


def graph(root):
    """{module: the modules it imports} over the package at root."""
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(arrows):
    """One cycle [a, b, ..., a] per strongly connected set of modules that import each other (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(arrows[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while v not in members:
                members.add(stack.pop())
            on_stack.difference_update(members)
            if len(members) > 1:
                found.append(_path_through(min(members), members, arrows))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def _path_through(start, members, arrows):
    """A shortest cycle start -> ... -> start inside `members` (breadth first)."""
    before, queue = {}, [start]
    for v in queue:
        for w in sorted(arrows[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(before[path[-1]])
                return [*reversed(path), start]
            if w not in before:
                before[w] = v
                queue.append(w)
    raise AssertionError(f"{sorted(members)} hold no cycle through {start}")


def upward(root, entry_modules):
    """{module: the entry modules it imports} for the modules inside a subpackage of root that import any."""
    known = modules(root)
    found = {name: sorted(imports(name, path, known) & entry_modules)
             for name, path in known.items() if path.parent != root}
    return {name: entry for name, entry in found.items() if entry}


def test_the_package_has_no_import_cycle():
    found = cycles(graph(PACKAGE))
    listed = "\n".join("  " + " -> ".join(c) for c in found)
    assert {frozenset(c) for c in found} == KNOWN, f"import cycles among pydtnn modules:\n{listed}"


def test_no_subpackage_imports_the_command_line():
    """Modules of pydtnn/backends, perfmodel, distributed, layers, ... never import cli, run, preflight,
    report, resume, export or plot: the command line is the top layer."""
    assert upward(PACKAGE, ENTRY_MODULES) == {}


def write(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def toy(tmp_path):
    """A package `pkg` whose modules import each other in every form the graph must see."""
    root = tmp_path / "pkg"
    write(root, {
        "__init__.py": "from pkg.sub import api\n",
        "cli.py": "",
        "sub/__init__.py": "",
        "sub/api.py": "from . import helpers\n",                     # relative, `from package import module`
        "sub/helpers.py": "def f():\n    from ..sub.api import g\n",   # relative, inside a function
        "sub/leaf.py": "import pkg.sub.helpers\nfrom pkg import cli\n",
    })
    return root


def test_the_graph_sees_every_form_of_import(toy):
    arrows = graph(toy)
    assert arrows["pkg"] == {"pkg.sub.api"}
    assert arrows["pkg.sub.api"] == {"pkg.sub.helpers"}
    assert arrows["pkg.sub.helpers"] == {"pkg.sub.api"}
    assert arrows["pkg.sub.leaf"] == {"pkg.sub.helpers", "pkg.cli"}
    assert cycles(arrows) == [["pkg.sub.api", "pkg.sub.helpers", "pkg.sub.api"]]
    assert upward(toy, {"pkg.cli"}) == {"pkg.sub.leaf": ["pkg.cli"]}


def test_a_longer_cycle_is_reported_in_order(tmp_path):
    root = tmp_path / "pkg"
    write(root, {"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "import pkg.c\n",
                 "c.py": "def late():\n    from pkg.a import x\n"})
    assert cycles(graph(root)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
