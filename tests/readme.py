"""The README's code blocks, as `make tour` and tests/test_readme.py run them.

``python tests/readme.py SECTION LANGUAGE`` prints the first LANGUAGE block under the README's
``## SECTION`` heading: `make tour` runs the tour's block this way, so the tour is tested as written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(section: str, language: str, readme: Path = README) -> list[str]:
    """Every ``language`` code block under the heading ``## section`` (up to the next ``## `` heading)."""
    text = readme.read_text()
    heading = re.search(rf"^## {re.escape(section)}\n", text, flags=re.MULTILINE)
    if heading is None:
        raise SystemExit(f"{readme} has no section '## {section}'")
    body = text[heading.end() :]
    following = re.search(r"^## ", body, flags=re.MULTILINE)
    body = body[: following.start()] if following else body
    return re.findall(rf"^```{language}\n(.*?)^```$", body, flags=re.MULTILINE | re.DOTALL)


if __name__ == "__main__":
    section, language = sys.argv[1:]
    print(blocks(section, language)[0], end="")
