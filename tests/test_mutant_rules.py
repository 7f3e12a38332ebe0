"""The rules by which tests/mutants/kill_rate.py reports a surviving mutant apart as equivalent:
each accepts the mutants it names and nothing that changes what the code computes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("rules", Path(__file__).parent / "mutants" / "rules.py")
rules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rules)


def function(body: str) -> str:
    return f"def f(a, b, x):\n    {body}\n"


@pytest.mark.parametrize(
    ("original", "mutant", "reason"),
    [
        ('raise ValueError("bad x")', 'raise ValueError("XXbad xXX")', "error message"),
        ("return x.to(device=a)", "return x.to(device=None)", "device="),
        ("return x.to(device=a)", "return x.to()", "device="),
        ("return x[:, b.to(x.device)]", "return x[:, b.to(None)]", "device="),  # a move to another tensor's device
        ('return x.fill(float("inf"))', 'return x.fill(float("INF"))', "same number"),
        ('return x.fill(float("-inf"))', 'return x.fill(float("-INF"))', "same number"),
        ('return x.fill(float("nan"))', 'return x.fill(float("NAN"))', "same number"),
        ("return list(zip(a, b, strict=True))", "return list(zip(a, b, strict=False))", "strict=True"),
        ("return list(zip(a, b, strict=True))", "return list(zip(a, b, strict=None))", "strict=True"),
        ("return list(zip(a, b, strict=True))", "return list(zip(a, b, ))", "strict=True"),
    ],
)
def test_each_rule_names_the_mutants_it_covers(original, mutant, reason):
    found = rules.rule_reason(function(original), function(mutant))
    assert found is not None and reason in found


@pytest.mark.parametrize(
    ("original", "mutant"),
    [
        ('return x.fill(float("inf"))', 'return x.fill(float("XXinfXX"))'),  # no longer a number
        ('return x.fill(float("inf"))', 'return x.fill(float("-inf"))'),
        ('return x.fill(float("inf"))', "return x.fill(float(None))"),
        ("return list(zip(a, b, strict=False))", "return list(zip(a, b, strict=True))"),  # stricter
        ("return list(zip(a, b, strict=True))", "return list(zip(b, a, strict=False))"),
        ("return x.to(device=a)", "return x.to(device=b)"),
        ("return x.to(device=a, dtype=b)", "return x.to(device=a)"),
        ("return x.to(a.device)", "return x.to(b.device)"),  # another device
        ("return x.to(a.dtype)", "return x.to(None)"),  # a dtype, not a device
        ("return x.to(a.device)", "return x.to(a.device, b)"),
        ("return x.to(a.device)", "return y.to(a.device)"),
        ('raise ValueError("bad x")', 'raise TypeError("bad x")'),
        ('return "inf"', 'return "INF"'),  # a string the code returns, not one float() reads
        ("return a", "return a"),  # no change is no mutant
    ],
)
def test_no_rule_covers_a_mutant_that_changes_the_result(original, mutant):
    assert rules.rule_reason(function(original), function(mutant)) is None
