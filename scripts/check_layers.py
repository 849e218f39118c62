"""Checks the import layers of splitserve (docs/architecture.md): import-linter's contracts in pyproject.toml,
no import cycle between any two modules, and no two of the launcher's packages importing each other both
ways, imports inside functions included.

import-linter's graph builder (grimp) finds modules by walking the root package's folder, so on the source
tree it would see only splitserve/ and miss the parts that setuptools maps into it (engine/ ->
splitserve.engine, ...). This script therefore first lays the installed tree out in a temporary folder,
reading the mapping from pyproject.toml (``[tool.setuptools] packages`` and ``package-dir``: the one source
of truth, as the wheel build reads it), and checks that copy.

    python scripts/check_layers.py            # exit status 1 on a broken contract or a cycle
    python scripts/check_layers.py --keep DIR # lay the tree out in DIR and leave it there
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT_PACKAGE = "splitserve"
# The launcher's floor: between any two of these, imports go one way only.
LAUNCHER = [
    "splitserve.cli",
    "splitserve.planning",
    "splitserve.deploy",
    "splitserve.bench",
    "splitserve.client",
    "splitserve.tools",
]


def package_folders(pyproject: Path) -> dict[str, Path]:
    """Package name -> the folder its modules come from, as setuptools resolves ``package-dir``: the longest
    mapped prefix of the name, then the rest of the name as subfolders."""
    setuptools = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools.get("package-dir", {})
    folders: dict[str, Path] = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), -1, -1):
            prefix = ".".join(parts[:cut])
            if prefix in mapping or cut == 0:
                base = mapping.get(prefix, "")
                folders[package] = pyproject.parent.joinpath(base, *parts[cut:])
                break
    return folders


def lay_out(pyproject: Path, dest: Path) -> list[str]:
    """Copies every package's own .py files (not its subfolders: those are packages of their own, or are
    not installed) to ``dest/<package as a path>/``. Returns the packages laid out."""
    folders = package_folders(pyproject)
    for package, folder in folders.items():
        if not (folder / "__init__.py").is_file():
            raise SystemExit(f"pyproject.toml lists package {package!r}, but {folder}/__init__.py does not exist")
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in folder.glob("*.py"):
            shutil.copy2(source, target / source.name)
    return sorted(folders)


def find_cycles(graph) -> list[list[str]]:
    """Every set of modules that import each other in a loop (the strongly connected components with more
    than one module, Tarjan's algorithm, iterative so that a deep chain cannot hit the recursion limit)."""
    modules = sorted(m for m in graph.modules if m == ROOT_PACKAGE or m.startswith(ROOT_PACKAGE + "."))
    inside = set(modules)
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if n in inside) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def describe_cycle(graph, component: list[str]) -> str:
    members = set(component)
    lines = [f"  cycle between {len(component)} modules:"]
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            where = ", ".join(f"line {d['line_number']}" for d in details) or "?"
            lines.append(f"    {importer} -> {imported} ({where})")
    return "\n".join(lines)


def two_way_ties(graph, packages: list[str]) -> list[tuple[str, str]]:
    """Every pair of the given packages (or modules) that import each other both ways, counting the imports
    of any module inside each."""
    present = [p for p in packages if p in graph.modules]
    imports = {
        (a, b)
        for a in present
        for b in present
        if a != b and graph.direct_import_exists(importer=a, imported=b, as_packages=True)
    }
    return sorted((a, b) for a, b in imports if a < b and (b, a) in imports)


def check(tree: Path, pyproject: Path) -> bool:
    sys.path.insert(0, str(tree))
    import importlib.util

    import grimp
    from importlinter.application import use_cases
    from importlinter.configuration import configure

    origin = importlib.util.find_spec(ROOT_PACKAGE).origin
    if not origin or not Path(origin).is_relative_to(tree):
        raise SystemExit(f"{ROOT_PACKAGE} resolves to {origin}, not to the laid-out tree in {tree}")
    configure()
    contracts_kept = use_cases.lint_imports(config_filename=str(pyproject), cache_dir=None, no_logo=True)

    # Imports under `if TYPE_CHECKING:` count (docs/architecture.md says why), as in the contracts above.
    graph = grimp.build_graph(ROOT_PACKAGE, exclude_type_checking_imports=False, cache_dir=None)
    cycles = find_cycles(graph)
    if cycles:
        print(f"\nImport cycles: {len(cycles)} (imports inside functions and under TYPE_CHECKING included)")
        for component in cycles:
            print(describe_cycle(graph, component))
    else:
        print(f"\nNo import cycle among the {len(graph.modules)} modules of {ROOT_PACKAGE}.")
    ties = two_way_ties(graph, LAUNCHER)
    for a, b in ties:
        print(f"Two-way tie in the launcher: {a} and {b} import each other")
    if not ties:
        print("No two-way tie between the launcher's packages.")
    return contracts_kept and not cycles and not ties


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    parser.add_argument("--keep", type=Path, help="lay the installed tree out here and keep it")
    args = parser.parse_args(argv)
    pyproject = args.pyproject.resolve()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        lay_out(pyproject, args.keep.resolve())
        return 0 if check(args.keep.resolve(), pyproject) else 1
    with tempfile.TemporaryDirectory(prefix="splitserve-layers-") as tmp:
        lay_out(pyproject, Path(tmp))
        return 0 if check(Path(tmp), pyproject) else 1


if __name__ == "__main__":
    sys.exit(main())
