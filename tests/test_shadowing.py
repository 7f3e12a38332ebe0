"""tools/shadowing.py, the check `make lint` runs for a local name hiding an import (how
`make demo` once broke: ``summary = capture(...)`` and later ``summary(frame)``)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from shadowing import shadowings  # noqa: E402


def _hits(source: str) -> list[tuple[int, str, int]]:
    return sorted(shadowings(ast.parse(textwrap.dedent(source))))


def test_an_assignment_hiding_a_function_level_import_is_reported():
    source = """
    def run_demo():
        from rankkit.bench import summary
        summary = capture()
        return summary(frame)
    """
    assert _hits(source) == [(4, "summary", 3)]


def test_arguments_loops_with_except_and_nested_defs_hiding_module_imports_are_reported():
    source = """
    import torch
    from dataclasses import field
    from x import a, b, c, d

    def ratio(reference, field):
        for torch in range(3):
            pass
        with open(p) as a:
            pass
        try:
            pass
        except E as b:
            pass
        def c():
            pass
        d = [torch for torch in ()]
    """
    assert [name for _, name, _ in _hits(source)] == ["field", "torch", "a", "b", "c", "d", "torch"]


def test_a_class_method_and_a_lambda_are_scopes_too():
    source = """
    from x import head_sums

    class Policy:
        def decide_at_once(self, head_sums):
            return head_sums

    pick = lambda head_sums: head_sums
    """
    assert [(line, name) for line, name, _ in _hits(source)] == [(5, "head_sums"), (8, "head_sums")]


def test_reimports_module_qualified_use_and_other_scopes_are_not_reported():
    source = """
    import torch
    from rankkit import prompting

    def f():
        import torch
        answer = prompting.reference_answer()
        return torch.ones(1), answer

    def g():
        from y import summary
        return summary()

    def h(summary):  # g's import is g's alone
        return summary

    class C:
        torch_version = 2
    """
    assert _hits(source) == []


def test_the_project_has_no_shadowed_import():
    folders = ["rankkit", "cli", "probes", "stores", "tests", "tools"]
    finished = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "shadowing.py"), *(str(ROOT / f) for f in folders)],
        capture_output=True,
        text=True,
    )
    assert finished.returncode == 0, finished.stdout
