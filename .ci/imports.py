"""CI's import check: the project's own modules must import one way, with no cycle.

The modules: the top-level *.py (the test files aside), machinery/*.py, games/*.py and tools/*.py; a package's
__init__.py is the package (machinery/__init__.py is `machinery`). An edge is every `import` and `from ... import`
in a module's source, inside functions too, relative ones resolved; importlib's string imports are not seen.
It fails (exit 1) on
  - a cycle: one printed per strongly connected component, as `a -> b -> c -> a`;
  - a back arrow: an import against the order below, where a module imports only its own level or lower;
  - inside machinery/, an import of a module that is not in a lower layer of the table in machinery/__init__.py's
    docstring (a line "  N  name.py  ..." opens layer N; "     name.py  ..." joins the layer above), or a
    machinery module the table does not place.
Run from anywhere: `python .ci/imports.py [ROOT]` (ROOT defaults to the repository holding this file).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from pathlib import Path

# The stated order, highest first: tools/ -> spyrl.py -> stratagem.py -> games/ -> machinery/ -> judge_prompts.py.
ORDER = ["tools", "spyrl", "stratagem", "games", "machinery", "judge_prompts"]
PACKAGES = ["machinery", "games", "tools"]


def find_modules(root: Path) -> dict[str, Path]:
    """{dotted name: file} of the project's own modules."""
    files = [p for p in root.glob("*.py") if not p.name.startswith("test_")]
    for package in PACKAGES:
        files += root.glob(f"{package}/*.py")
    modules = {}
    for path in sorted(files):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{imported module: first line} for each project module that `name`'s source imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target != name:
            found.setdefault(target, line)

    def longest_module(dotted: str) -> str | None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                return ".".join(parts[:n])
        return None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if target := longest_module(alias.name):
                    add(target, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                if full in modules:  # `from pkg import module`
                    add(full, node.lineno)
                elif base and (target := longest_module(base)):  # a name from a module
                    add(target, node.lineno)
    return found


def machinery_layers(root: Path) -> dict[str, int]:
    """{machinery.NAME: layer} from the table in machinery/__init__.py's docstring."""
    layers, layer = {}, -1
    text = ast.get_docstring(ast.parse((root / "machinery" / "__init__.py").read_text())) or ""
    for line in text.splitlines():
        if m := re.match(r"  (\d+)?\s+(\w+)\.py\s", line):
            layer = int(m[1]) if m[1] else layer
            layers[f"machinery.{m[2]}"] = layer
    return layers


def level(name: str) -> int:
    """The module's place in ORDER (0 is the highest)."""
    return ORDER.index(name.split(".")[0])


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
                    components.append(sorted(component))
    return components


def one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, inside the component (breadth first)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node]):
            if target not in members:
                continue
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if target not in came_from:
                came_from[target] = node
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    modules = find_modules(root)
    unplaced = [name for name in modules if name.split(".")[0] not in ORDER]
    if unplaced:
        print(
            f"imports: not in the stated order (add to ORDER in .ci/imports.py): {', '.join(unplaced)}"
        )
        return 1
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    edges = sum(len(targets) for targets in graph.values())
    components = [c for c in strongly_connected(graph) if len(c) > 1]
    back = [
        (a, b, f"{modules[a].relative_to(root)}:{line}")
        for a in sorted(graph)
        for b, line in sorted(graph[a].items())
        if level(b) < level(a)
    ]
    if components:
        print(f"imports: {len(components)} cycle(s), one per strongly connected component:")
        for component in sorted(components):
            print("  " + " -> ".join(one_cycle(graph, component)))
            if len(component) > 2:  # the cycle shown may not pass through all of them
                print(f"    its component's {len(component)} modules: {', '.join(component)}")
    if back:
        print(f"imports: {len(back)} back arrow(s) against {' -> '.join(ORDER)}:")
        for a, b, where in back:
            print(f"  {a} -> {b}  ({where})")
    layers = machinery_layers(root)
    inner = [n for n in modules if n.startswith("machinery.")]
    unplaced = [n for n in inner if n not in layers]
    upward = [
        (a, b, f"{modules[a].relative_to(root)}:{line}")
        for a in inner
        for b, line in sorted(graph[a].items())
        if a in layers and b in layers and layers[b] >= layers[a]
    ]
    if unplaced:
        print(f"imports: not in machinery/__init__.py's table of layers: {', '.join(unplaced)}")
    if upward:
        print(
            f"imports: {len(upward)} import(s) not into a lower layer of machinery/__init__.py's table:"
        )
        for a, b, where in upward:
            print(f"  {a} (layer {layers[a]}) -> {b} (layer {layers[b]})  ({where})")
    if components or back or unplaced or upward:
        return 1
    print(
        f"imports: {len(modules)} modules, {edges} edges, no cycle, no back arrow; "
        f"machinery's {len(inner)} modules in {len(set(layers.values()))} layers, each importing lower ones"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
