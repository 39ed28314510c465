"""docs/architecture.md's map of the package names every file and folder of the package, and nothing else."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def mapped_paths():
    """The paths the map names: each line's leading names (ending in .py or /), nested by indentation;
    a line that starts with no name continues the description above it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## The house", 1)[1].split("```", 2)[1]
    paths, stack = set(), []  # stack: (indent, folder)
    for line in block.splitlines():
        if not line.strip():
            continue
        names = []
        for token in line.split():
            if not (token.endswith(".py") or token.endswith("/")):
                break
            names.append(token)
        if not names:  # a description's second line
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "".join(folder for _, folder in stack)
        for name in names:
            paths.add(prefix + name)
        if len(names) == 1 and names[0].endswith("/"):
            stack.append((indent, names[0]))
    return paths


def tree_paths():
    package = ROOT / "pydtnn"
    paths = {"pydtnn/"}
    for p in package.rglob("*"):
        rel = p.relative_to(ROOT).as_posix()
        if "__pycache__" in rel or "/mnist5k/" in rel:
            continue
        if p.is_dir():
            paths.add(rel + "/")
        elif p.suffix == ".py":
            paths.add(rel)
    return paths


def test_the_architecture_map_matches_the_package_tree():
    mapped, tree = mapped_paths(), tree_paths()
    assert sorted(tree - mapped) == [], "files missing from docs/architecture.md's map"
    assert sorted(mapped - tree) == [], "files in docs/architecture.md's map that do not exist"


def test_no_function_of_the_package_is_over_80_lines():
    """A function a reader takes in at once: over 80 lines, split it into named steps (run(), build_parser())."""
    import ast

    long = []
    for path in sorted((ROOT / "pydtnn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({size} lines)")
    assert long == [], long


def test_no_file_of_the_package_is_over_600_lines():
    """A file says one thing: over 600 lines, split it by concern (export.py, checkpoint.py, perfmodel/costs.py)."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted((ROOT / "pydtnn").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert long == [], long
