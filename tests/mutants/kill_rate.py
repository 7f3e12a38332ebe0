"""Print the kill rate of a mutmut run and its surviving mutants, from ``mutmut junitxml`` on stdin.

Exit status 2 when the rate is below the floor given as the first argument (a share, e.g. 0.9).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree


def main() -> int:
    floor = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    cases = ElementTree.parse(sys.stdin).getroot().iter("testcase")
    total, survivors = 0, []
    for case in cases:
        total += 1
        if case.find("failure") is not None or case.find("skipped") is not None:
            survivors.append(f"{case.get('file')}:{case.get('line')} {case.get('name')}")
    if not total:
        print("no mutants were checked")
        return 2
    rate = (total - len(survivors)) / total
    print(f"killed {total - len(survivors)} of {total} mutants: {rate:.1%}")
    for survivor in survivors:
        print(f"  survived: {survivor} (`mutmut show {survivor.rsplit('#', 1)[-1]}`)")
    return 2 if rate < floor else 0


if __name__ == "__main__":
    sys.exit(main())
