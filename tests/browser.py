"""Open a dashboard in headless Chromium, offline, and read the status the page writes about itself.

The page opened is a copy of the dashboard with ``assets/selftest.js`` injected (the test
hook that steps every control when the fragment has ``selftest``); the dashboard itself
carries no test code.

    report = open_in_chromium(Path("report.html"), screenshot=Path("report.png"))
    report.status["errors"], report.status["panels"], report.seconds

Only Chromium's command line is used: ``--dump-dom`` after a virtual-time budget returns the
DOM once the page's timers have run, including ``<pre id="rankkit-status">`` (see
``rankkit.report.html``); ``--screenshot`` takes the picture in a second run.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankkit.errors import RankkitError

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# Flags that keep Chromium off the network and out of the user's profile.
OFFLINE_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
VIRTUAL_TIME_BUDGET_MS = 20_000
SELFTEST_JS = Path(__file__).with_name("assets") / "selftest.js"
STATUS = re.compile(r'<pre id="rankkit-status"[^>]*>(.*?)</pre>', re.DOTALL)


@dataclass(frozen=True)
class BrowserReport:
    status: dict[str, Any]  # what the page wrote into #rankkit-status
    seconds: float  # wall time of the --dump-dom run: Chromium start, parse, render, dump


def find_chromium() -> str | None:
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def with_test_hook(page: Path) -> Path:
    """A copy of ``page`` beside it with the self-test hook in its head, before the dashboard's runtime."""
    text = page.read_text(encoding="utf-8")
    # The title is escaped text, so its end tag comes before any script that could contain one.
    hooked = text.replace(
        "</title>", f"</title>\n<script>{SELFTEST_JS.read_text(encoding='utf-8')}</script>", 1
    )
    target = page.with_name(f"{page.stem}.selftest{page.suffix}")
    target.write_text(hooked, encoding="utf-8")
    return target


def _run(chromium: str, arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="rankkit-chromium-") as profile:
        return subprocess.run(
            [chromium, *OFFLINE_FLAGS, f"--user-data-dir={profile}", *arguments],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def open_in_chromium(
    page: Path,
    *,
    screenshot: Path | None = None,
    fragment: str = "",
    window: tuple[int, int] = (1400, 3600),
    timeout: float = 120.0,
) -> BrowserReport:
    """Render ``page`` (with ``#fragment`` control values) and return its status; RankkitError without Chromium."""
    chromium = find_chromium()
    if chromium is None:
        raise RankkitError("no Chromium found; install it with `make browser` (apt-get install chromium)")
    url = with_test_hook(page).resolve().as_uri() + (f"#{fragment}" if fragment else "")
    budget = f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}"
    started = time.perf_counter()
    dumped = _run(chromium, [budget, "--dump-dom", url], timeout)
    seconds = time.perf_counter() - started
    found = STATUS.search(dumped.stdout)
    if found is None or not found.group(1).strip():
        raise RankkitError(
            f"the page wrote no status (chromium exit {dumped.returncode}): {dumped.stderr.strip()[-300:]}"
        )
    if screenshot is not None:
        size = f"--window-size={window[0]},{window[1]}"
        _run(
            chromium,
            [budget, "--hide-scrollbars", size, f"--screenshot={screenshot.resolve()}", url],
            timeout,
        )
    return BrowserReport(json.loads(html.unescape(found.group(1))), seconds)
