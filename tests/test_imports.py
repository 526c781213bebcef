"""The package has no import cycle, counting imports inside functions too: a cycle
dodged with a function-level import is still a cycle. No module imports another's private
(underscore) name, and an import of a package module is inside a function only where that keeps
torch, megatron or matplotlib out of the importing module (`slimpack --help` and the planner
never import them)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_slimpack"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        # the most specific module named (a package's __init__ only when nothing below it is)
        found |= {target for target in targets if target in modules}
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path, name, set(paths)) for name, path in paths.items()}
    for name, targets in graph.items():  # `from .x import y` with y a module: the edge goes to x.y only
        graph[name] = {t for t in targets if not any(other.startswith(t + ".") and other in targets
                                                      for other in targets)}
    return graph


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            assert state.get(target) != 1, f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# ---- private names, lazy imports -----------------------------------------------------------------

HEAVY = ("torch", "megatron", "matplotlib")  # top-level packages only a run on the model needs
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def parsed() -> dict[str, tuple[Path, ast.Module]]:
    return {module_name(path): (path, ast.parse(path.read_text())) for path in PACKAGE.rglob("*.py")}


def is_main_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def run_by(node: ast.AST):
    """The nodes that running `node`'s code evaluates: not the bodies of the functions (lambdas
    included) it defines, but their decorators and defaults; not `if __name__ == "__main__":`."""
    for child in ast.iter_child_nodes(node):
        if is_main_block(child):
            continue
        if isinstance(child, FUNCTIONS):
            yield child
            for part in [*child.decorator_list, *child.args.defaults, *child.args.kw_defaults]:
                if part is not None:
                    yield part
                    yield from run_by(part)
        elif not isinstance(child, ast.Lambda):
            yield child
            yield from run_by(child)


def called_names(nodes):
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            yield node.func.id
        elif isinstance(node, (*FUNCTIONS, ast.ClassDef)):
            yield from (decorator.id for decorator in node.decorator_list if isinstance(decorator, ast.Name))


def import_statements(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import node, whether it is lazy) for every import of the module. Not lazy: those the
    module's import runs, at module level (class bodies included) or in a module-level function
    that code calls or decorates with (transitively)."""
    functions = {statement.name: statement for statement in tree.body if isinstance(statement, FUNCTIONS)}
    at_import: set[ast.AST] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        code = list(run_by(todo.pop()))
        at_import |= {node for node in code if isinstance(node, (ast.Import, ast.ImportFrom))}
        for name in called_names(code):
            function = functions.pop(name, None)  # each function once
            if function is not None:
                todo.append(function)
    return [(node, node not in at_import) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def bound_at_module_level(tree: ast.Module) -> set[str]:
    names = set()
    for statement in tree.body:
        if isinstance(statement, (*FUNCTIONS, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
        else:
            names |= {node.id for node in ast.walk(statement) if isinstance(node, ast.Name)
                      and isinstance(node.ctx, ast.Store)}
    return names


def ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def what_it_runs(node, name: str, path: Path, trees) -> tuple[set[str], set[str]]:
    """(package modules, third-party packages of HEAVY) that the import statement `node` of module
    `name` imports itself, not counting what those import in turn (a name served by a module's
    `__getattr__`: see `served_by_getattr`)."""
    modules, heavy = set(), set()
    if isinstance(node, ast.Import):
        pairs = [(alias.name, None) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = (name if path.name == "__init__.py" else name.rsplit(".", 1)[0]).split(".")
            base = ".".join(anchor[:len(anchor) - (node.level - 1)] + ([node.module] if node.module else []))
        pairs = [(base, alias.name) for alias in node.names]
    for base, attribute in pairs:
        if base.split(".")[0] in HEAVY:
            heavy.add(base.split(".")[0])
        if base not in trees:
            continue
        modules |= {module for module in ancestors(base) if module in trees}
        if attribute is None:
            continue
        if f"{base}.{attribute}" in trees:
            modules.add(f"{base}.{attribute}")
        elif attribute not in bound_at_module_level(trees[base][1]):
            modules |= served_by_getattr(base, trees)
    return modules - {name}, heavy


def served_by_getattr(module: str, trees) -> set[str]:
    """What a name that `module` serves from its module-level `__getattr__` (PEP 562) may import:
    the modules that `__getattr__` imports and, for a package, any module in it (`import_module`;
    an old module path that `_moved` redirects is in the package as well)."""
    path, tree = trees[module]
    function = next((statement for statement in tree.body
                     if isinstance(statement, FUNCTIONS) and statement.name == "__getattr__"), None)
    if function is None:
        return set()
    found = {other for other in trees if path.name == "__init__.py" and other.startswith(module + ".")}
    for node in ast.walk(function):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= what_it_runs(node, module, path, trees)[0]
    return found


def heavy_closures(trees) -> dict[str, set[str]]:
    """Module -> the packages of HEAVY that importing it imports: through its parent packages and
    its imports that are not lazy, transitively."""
    edges, heavy = {}, {}
    for name, (path, tree) in trees.items():
        edges[name] = {module for module in ancestors(name)[:-1] if module in trees}
        heavy[name] = set()
        for node, lazy in import_statements(tree):
            if not lazy:
                modules, roots = what_it_runs(node, name, path, trees)
                edges[name] |= modules
                heavy[name] |= roots
    changed = True
    while changed:
        changed = False
        for name in trees:
            for target in edges[name]:
                if not heavy[target] <= heavy[name]:
                    heavy[name] |= heavy[target]
                    changed = True
    return heavy


def test_no_module_imports_another_modules_private_name():
    trees = parsed()
    found = []
    for name, (path, tree) in trees.items():
        for node, _ in import_statements(tree):
            if isinstance(node, ast.ImportFrom) and what_it_runs(node, name, path, trees)[0]:
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno}: `{ast.unparse(node)}` imports the private "
                          f"name {alias.name}: make it public in the module that defines it" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.endswith("__")]
    assert not found, "\n".join(found)


def test_package_modules_are_imported_in_functions_only_to_keep_torch_megatron_matplotlib_out():
    trees = parsed()
    heavy = heavy_closures(trees)
    found = []
    for name, (path, tree) in trees.items():
        for node, lazy in import_statements(tree):
            modules, roots = what_it_runs(node, name, path, trees) if lazy else (set(), set())
            if not modules:
                continue
            if not (roots | set().union(*(heavy[module] for module in modules))) - heavy[name]:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: `{ast.unparse(node)}` is inside a "
                             f"function but keeps none of {', '.join(HEAVY)} out of {name} (which imports "
                             f"{', '.join(sorted(heavy[name])) or 'none of them'}): import it at module level")
    assert not found, "\n".join(found)
