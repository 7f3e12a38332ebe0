"""The rules by which ``kill_rate.py`` reports a surviving mutant apart as equivalent.

Each compares the unmutated function's source with the mutant's (plain ``ast``, so the rules are
tested in ``make test`` without mutmut installed); ``kill_rate.py``'s docstring says why each holds.
"""

from __future__ import annotations

import ast


def plain_fields(node: ast.AST) -> list:
    """A node's own values (not its children): what tells two nodes of one type apart."""
    values = []
    for field in node._fields:
        value = getattr(node, field, None)
        if isinstance(value, list):
            values.append(len(value))
        elif not isinstance(value, ast.AST):
            values.append(value)
    return values


def in_message(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn":
            return True
    return False


def changes_only_a_message(original: str, mutant: str) -> bool:
    """Whether the mutant differs from the original only in strings inside error messages."""
    before, after = ast.parse(original), ast.parse(mutant)
    parents = {child: node for node in ast.walk(before) for child in ast.iter_child_nodes(node)}
    changed = []
    nodes_before, nodes_after = list(ast.walk(before)), list(ast.walk(after))
    if len(nodes_before) != len(nodes_after):
        return False
    for old, new in zip(nodes_before, nodes_after, strict=True):
        if type(old) is not type(new):
            return False
        if plain_fields(old) == plain_fields(new):
            continue
        if not (isinstance(old, ast.Constant) and isinstance(old.value, str) and isinstance(new.value, str)):
            return False
        changed.append(old)
    return bool(changed) and all(in_message(node, parents) for node in changed)


def without_device_arguments(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            node.keywords = [keyword for keyword in node.keywords if keyword.arg != "device"]
            if _moves_to_a_device(node):
                node.args = []
    return tree


def _moves_to_a_device(node: ast.Call) -> bool:
    """``x.to(y.device)`` or ``x.to(None)``: a move whose one argument is another tensor's device (or none)."""
    if not (isinstance(node.func, ast.Attribute) and node.func.attr == "to" and len(node.args) == 1):
        return False
    (argument,) = node.args
    return _is_none(argument) or (isinstance(argument, ast.Attribute) and argument.attr == "device")


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def with_float_literals_read(tree: ast.AST) -> ast.AST:
    """Each ``float("...")`` of a literal replaced by the number Python reads from it."""
    for node in ast.walk(tree):
        if _calls(node, "float") and len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
            try:
                node.args[0].value = repr(float(node.args[0].value))
            except (TypeError, ValueError):
                pass
    return tree


def _calls(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _strict_zips(tree: ast.AST) -> int:
    return sum(
        1
        for node in ast.walk(tree)
        if _calls(node, "zip")
        for keyword in node.keywords
        if keyword.arg == "strict" and isinstance(keyword.value, ast.Constant) and keyword.value.value is True
    )


def without_zip_strictness(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if _calls(node, "zip"):
            node.keywords = [keyword for keyword in node.keywords if keyword.arg != "strict"]
    return tree


def changes_only(original: str, mutant: str, normalized) -> bool:
    """Whether the mutant differs from the original, but not once both are ``normalized``."""
    if ast.dump(ast.parse(original)) == ast.dump(ast.parse(mutant)):
        return False
    return ast.dump(normalized(ast.parse(original))) == ast.dump(normalized(ast.parse(mutant)))


def _devices_named(tree: ast.AST) -> list[str]:
    """The ``device=`` arguments and ``.to(y.device)`` moves that name a device (not ``None``), in order."""
    named = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        named += [keyword.value for keyword in node.keywords if keyword.arg == "device"]
        if _moves_to_a_device(node):
            named.append(node.args[0])
    return [ast.dump(device) for device in named if not _is_none(device)]


def changes_only_a_device(original: str, mutant: str) -> bool:
    """Whether the mutant differs from the original only in a ``device=`` argument (or the device of a
    ``.to(y.device)`` move) it drops or nulls."""
    before, after = _devices_named(ast.parse(original)), _devices_named(ast.parse(mutant))
    dropped_only = all(before.count(device) >= after.count(device) for device in after)
    return dropped_only and changes_only(original, mutant, without_device_arguments)


def changes_only_a_float_spelling(original: str, mutant: str) -> bool:
    """Whether the mutant only respells a ``float()`` literal as the same number (``"INF"``)."""
    return changes_only(original, mutant, with_float_literals_read)


def only_loosens_a_strict_zip(original: str, mutant: str) -> bool:
    """Whether the mutant only turns a ``zip(..., strict=True)`` into a zip that does not check."""
    loosened = _strict_zips(ast.parse(mutant)) < _strict_zips(ast.parse(original))
    return loosened and changes_only(original, mutant, without_zip_strictness)


# Mutants that no run on the CPU tells apart, by rule: reported apart with the reason, never dropped.
RULES = (
    (changes_only_a_message, "changes only an error message's text"),
    (
        changes_only_a_device,
        "drops a device= argument or a .to(y.device) move's device, the CPU either way on the CPU (a GPU run tells)",
    ),
    (
        changes_only_a_float_spelling,
        "spells a float() literal as another that Python reads as the same number",
    ),
    (
        only_loosens_a_strict_zip,
        "loosens a zip's strict=True, which acts only on iterables of unequal length, a bug the code never has",
    ),
)


def rule_reason(original: str, mutant: str) -> str | None:
    """Why the mutant is equivalent by one of the RULES, or None."""
    return next((reason for applies, reason in RULES if applies(original, mutant)), None)
