"""The code's shape, checked statically with ``ast``: no import cycle between Kiln's training modules (the
engine's rooms import one way; a package may import its own modules and they it)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def training_imports() -> dict[str, set[str]]:
    """Each module of training/ -> the modules of training/ it imports, at its top or inside a function."""
    modules = {_module_name(path): path for path in (ROOT / "training").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                cycles.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_training_modules():
    """A cycle inside one package (its __init__ importing its modules, which import names from it) is allowed;
    any other is a circle, as trainer <-> evaluation was before the compiled step moved to training/step.py."""
    graph = training_imports()
    assert "training.step" in graph["training.trainer"] and "training.step" in graph["training.evaluation"]
    circles = [sorted(cycle) for cycle in import_cycles(graph)
               if not any(all(m == package or m.startswith(package + ".") for m in cycle) for package in cycle)]
    assert circles == []
