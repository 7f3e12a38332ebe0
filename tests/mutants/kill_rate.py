"""Print the kill rate of ``make mutants`` (mutmut 3) and every mutant not killed.

``python tests/mutants/kill_rate.py FLOOR [GLOB ...]``, from the repository root after ``mutmut run``:
per file the mutants killed, survived, equivalent and not yet checked; then each survivor (``mutmut
show NAME`` prints its diff) and each equivalent mutant with its reason. The rate is killed / (checked
- equivalent); timeouts count as killed. A mutant is equivalent, and reported apart, never dropped:

* as import-time, when no test reaches its function after the modules are imported (a dataclass
  field's ``bounded(...)``): the children mutmut forks inherit the imported modules, so no run of
  the tests can see such a mutant (``mutmut_harness.py`` records these functions);
* by rule, when it changes only the text of a string inside a ``raise`` statement or a
  ``warnings.warn`` call (an error message: the tests check the error, not its wording);
* by rule, when it only drops a call's ``device=`` argument or makes it ``None`` (or the device
  of a move to another tensor's, ``x.to(y.device)``): the tests run on the CPU, where torch's
  default device is every tensor's own, so only a GPU run can tell (the report names these
  apart so that a GPU run of ``make mutants`` can be read against it);
* by rule, when it only respells a ``float()`` literal as one Python reads as the same number
  (``float("INF")`` is ``float("inf")``);
* by rule, when it only loosens a ``zip(..., strict=True)`` (to ``False``, ``None`` or no
  argument): the check acts only on iterables of unequal length, which a correct caller never
  passes, so only a bug elsewhere could tell the two apart;
* by entry in ``tests/mutants/equivalent.toml``: its name, the one changed line of its diff
  (``-`` and ``+`` lines), and why no run can tell it apart. An entry whose diff no longer matches
  (the code moved and mutmut renumbered) is reported as stale and the mutant counts as a survivor.

Exit status 2 when the rate is below FLOOR (a share, e.g. 0.9), when nothing was checked, or when
mutants remain unchecked (rerunning ``make mutants`` continues where it stopped).
"""

from __future__ import annotations

import fnmatch
import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

import libcst as cst
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import (
    get_diff_for_mutant,
    read_functions_from_index,
    read_mutant_function,
    read_mutants_module,
    read_original_function,
)
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files
from mutmut.utils.format_utils import mangled_name_from_mutant_name
from rules import rule_reason

EQUIVALENT = Path(__file__).with_name("equivalent.toml")
# Written by mutmut_harness.py: the functions that ran only while the modules were imported.
IMPORT_TIME = Path("mutants/mutmut-import-time.json")
KILLED = {"killed", "timeout", "caught by type check"}


def function_sources(name: str, path: Path) -> tuple[str, str]:
    """The unmutated function and the mutant, as source."""
    functions = read_functions_from_index(name, path)
    if functions is None:
        module = read_mutants_module(path)
        functions = (read_original_function(module, name), read_mutant_function(module, name))
    return tuple(cst.Module([function]).code for function in functions)


def changed_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def main() -> int:
    floor = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    patterns = sys.argv[2:]
    listed = tomllib.loads(EQUIVALENT.read_text())["mutant"] if EQUIVALENT.exists() else []
    entries = {entry["name"]: entry for entry in listed}
    import_time = set(json.loads(IMPORT_TIME.read_text())) if IMPORT_TIME.exists() else set()
    per_file: dict[str, Counter] = {}
    survivors, equivalent, stale = [], [], []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        counts = per_file.setdefault(str(path), Counter())
        for name, exit_code in data.exit_code_by_key.items():
            if patterns and not any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                continue
            status = status_by_exit_code[exit_code]
            counts["mutants"] += 1
            if status == "not checked":
                counts["unchecked"] += 1
            elif status in KILLED:
                counts["killed"] += 1
            elif status == "no tests" and mangled_name_from_mutant_name(name) in import_time:
                counts["equivalent"] += 1
                equivalent.append(f"{name}: runs only while its module is imported")
            elif (
                name in entries
                and changed_lines(get_diff_for_mutant(name, path=path)) == entries[name]["change"]
            ):
                counts["equivalent"] += 1
                equivalent.append(f"{name}: {entries[name]['reason']}")
            elif (reason := rule_reason(*function_sources(name, path))) is not None:
                counts["equivalent"] += 1
                equivalent.append(f"{name}: {reason}")
            else:
                counts["survived"] += 1
                survivors.append(f"{name} ({status})")
                if name in entries:
                    stale.append(name)
    total = Counter()
    print(f"{'file':40} {'mutants':>8} {'killed':>7} {'survived':>9} {'equivalent':>11} {'unchecked':>10}")
    for path, counts in per_file.items():
        if counts["mutants"]:
            total += counts
            print(
                f"{path:40} {counts['mutants']:8} {counts['killed']:7} {counts['survived']:9}"
                f" {counts['equivalent']:11} {counts['unchecked']:10}"
            )
    for survivor in survivors:
        print(f"  survived: {survivor}")
    for name in stale:
        print(f"  stale entry in {EQUIVALENT.name} (its diff changed; counted as a survivor): {name}")
    for entry in equivalent:
        print(f"  equivalent: {entry}")
    judged = total["killed"] + total["survived"]
    if not judged:
        print("no mutants were checked")
        return 2
    rate = total["killed"] / judged
    print(
        f"killed {total['killed']} of {judged} mutants: {rate:.1%}"
        f" ({total['equivalent']} equivalent reported apart; `mutmut show NAME` prints a diff)"
    )
    if total["unchecked"]:
        print(f"{total['unchecked']} mutants not checked yet: rerun `make mutants` to continue")
        return 2
    return 2 if rate < floor else 0


if __name__ == "__main__":
    sys.exit(main())
