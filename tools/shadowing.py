"""Report every name that a function binds (argument, assignment, loop, ``with``, ``except``,
comprehension, nested ``def``) while an import of the same name is in scope.

ruff has no such rule: its F811 sees an import redefined by another import or ``def``, and F402 a
loop variable, but not ``summary = capture(...)`` two lines before calling the imported
``summary``, which is how `make demo` broke. Usage: ``python tools/shadowing.py PATH...``; exits 1
and prints ``file:line: ...`` per hit.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def imported_names(statements: Iterable[ast.AST]) -> dict[str, int]:
    """The names the import statements among ``statements`` bind, with their lines (nested
    functions and classes excluded: they are scopes of their own)."""
    names: dict[str, int] = {}
    for node in _own_scope(statements):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                names[alias.asname or alias.name] = node.lineno
    return names


def _own_scope(statements: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node of these statements that belongs to their scope, plus the nested definitions
    themselves (their names bind here) but not the definitions' bodies."""
    pending = list(statements)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
            # Decorators and defaults are evaluated in this scope; the body is not.
            pending.extend(getattr(node, "decorator_list", []))
            if not isinstance(node, ast.ClassDef):
                pending.extend(d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None)
            continue
        pending.extend(ast.iter_child_nodes(node))


def _bound_names(function: ast.AST) -> Iterator[tuple[str, int]]:
    """What ``function`` binds other than by import: its arguments and local bindings."""
    arguments = function.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs):
        yield argument.arg, argument.lineno
    for argument in (arguments.vararg, arguments.kwarg):
        if argument is not None:
            yield argument.arg, argument.lineno
    body = function.body if isinstance(function.body, list) else [function.body]
    for node in _own_scope(body):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, node.lineno
        elif isinstance(node, ast.ExceptHandler) and node.name:
            yield node.name, node.lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno


def shadowings(tree: ast.Module) -> Iterator[tuple[int, str, int]]:
    """(line, name, import line) for each binding that hides an import visible in its scope."""

    def visit(scope_body: list[ast.AST], visible: dict[str, int]) -> Iterator[tuple[int, str, int]]:
        for node in _own_scope(scope_body):
            if isinstance(node, FUNCTIONS):
                body = node.body if isinstance(node.body, list) else [node.body]
                own_imports = imported_names(body)
                in_scope = {**visible, **own_imports}
                for name, line in _bound_names(node):
                    if name in in_scope:
                        yield line, name, in_scope[name]
                yield from visit(body, in_scope)
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, visible)

    yield from visit(tree.body, imported_names(tree.body))


def main(paths: list[str]) -> int:
    hits = 0
    for path in sorted({file for root in paths for file in _python_files(Path(root))}):
        for line, name, import_line in sorted(set(shadowings(ast.parse(path.read_text(), str(path))))):
            print(f"{path}:{line}: '{name}' hides the import of line {import_line}")
            hits += 1
    return 1 if hits else 0


def _python_files(root: Path) -> Iterator[Path]:
    yield from [root] if root.is_file() else root.rglob("*.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
