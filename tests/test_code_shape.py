"""The code's shape, checked statically with ``ast``: no function over ``MAX_FUNCTION_LINES`` lines outside the tests
(a long function does several jobs), and no import cycle between Kiln's training modules (the engine's rooms import
one way; a package may import its own modules and they it)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("training", "assets", "pipelines", "resources", "benchmarks")
MAX_FUNCTION_LINES = 60
# argparse's builder calls: a statement that is one of them (its value, or the outermost call of a chain) declares
# a command-line option, and a function's lines of such statements do not count towards its length
ARGPARSE_BUILDERS = {"ArgumentParser", "add_argument", "add_parser", "add_subparsers", "add_argument_group",
                     "add_mutually_exclusive_group", "set_defaults"}


def _builds_argparse(statement: ast.stmt) -> bool:
    value = statement.value if isinstance(statement, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
    if not isinstance(value, ast.Call):
        return False
    called = value.func
    return (called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)) in ARGPARSE_BUILDERS


def function_lengths(source: str, filename: str = "<source>") -> dict[str, int]:
    """Each function's (and method's, by ``Class.method``) length in lines, from its ``def`` to its last line,
    less the lines of the argparse-building statements of its body (``ARGPARSE_BUILDERS``)."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                argparse_lines = sum(s.end_lineno - s.lineno + 1 for s in child.body if _builds_argparse(s))
                lengths[prefix + child.name] = child.end_lineno - child.lineno + 1 - argparse_lines
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename), "")
    return lengths


def test_function_lengths_count_from_def_to_the_last_line_less_argparse_declarations():
    source = ("import argparse\n"
              "def cli(argv):\n"
              "    parser = argparse.ArgumentParser(prog='x')\n"
              "    parser.add_argument('--a',\n"
              "                        help='two lines')\n"
              "    commands = parser.add_subparsers(dest='c')\n"
              "    commands.add_parser('run').set_defaults(handler=print)\n"
              "    return parser.parse_args(argv)\n"
              "class Step:\n"
              "    def run(self):\n"
              "        def inner():\n"
              "            return 1\n"
              "        return inner()\n")
    assert function_lengths(source) == {"cli": 2, "Step.run": 4, "Step.run.inner": 2}


def test_no_function_outside_the_tests_is_longer_than_the_limit():
    """Long functions do several jobs: split them (argparse declarations aside, which only list options)."""
    too_long = [f"{path.relative_to(ROOT)}:{name}:{length}"
                for directory in CODE_DIRS for path in sorted((ROOT / directory).rglob("*.py"))
                for name, length in function_lengths(path.read_text(), str(path)).items()
                if length > MAX_FUNCTION_LINES]
    assert too_long == [], f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


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
