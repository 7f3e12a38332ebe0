"""The pytest plugin ``make mutants`` loads into mutmut 3 (``-p mutmut_harness``, with ``tests/mutants``
on ``PYTHONPATH``), before any test imports rankkit.

* ``rankkit.probes.X`` is the very module ``probes.X`` of mutmut's copy. rankkit installs its side
  folder ``probes/`` inside the rankkit namespace (pyproject's ``package-dir``), so the code imports
  ``rankkit.probes.X``; mutmut copies the sources into ``mutants/``, names each mutant after its
  file's path (``probes.X``) and switches a mutant on only in a function whose ``__module__`` has
  that name. Without the alias the editable install would load the unmutated ``probes/`` and every
  probe mutant would survive untested.
* Each mutant's child is forked from mutmut's fork server (pyproject: ``process_isolation =
  "forkserver"``), which has imported the tests but run none, so torch and the model classes are
  imported once. Forked from the process that ran the tests, a child inherits the locks of the
  thread pools those tests started (polars', zarr's, OpenMP's) and could wait on one forever:
  such mutants ended as "timeouts", counted killed with no test failing.
* For the same reason the tokenizers' Rust pool is off, and torch stays on one thread
  (``torch.set_num_threads`` is held at one against the tests' session fixture, ``--threads``
  and the bench): two children on two cores gain nothing from more threads anyway.
* Functions that run while the modules are imported (a dataclass field's ``bounded(...)``) are
  listed in ``mutmut-import-time.json`` and left out of the test mapping: every forked child
  inherits the imported modules, so no test can see their mutants, which ``kill_rate.py`` reports
  apart as import-time (mutmut would otherwise charge them to the first test and call them survived).
* The tests of a mutant run fastest first (durations from mutmut's stats): with ``-x`` a killed
  mutant stops at its first failing test, so the cheap exact-value tests decide most mutants.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

SIDE_FOLDERS = ("probes",)
# Written by mutmut into its working copy, where the tests run.
STATS = Path("mutmut-stats.json")
IMPORT_TIME = Path("mutmut-import-time.json")


class SideFolderAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``rankkit.<side folder>[.X]`` to the top-level module ``<side folder>[.X]``."""

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "rankkit" or parts[1] not in SIDE_FOLDERS:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        # The import system keeps the returned module's own name, spec and path.
        return importlib.import_module(spec.name.removeprefix("rankkit."))

    def exec_module(self, module):
        """Already executed under its top-level name."""


if not any(isinstance(finder, SideFolderAlias) for finder in sys.meta_path):
    sys.meta_path.insert(0, SideFolderAlias())
os.environ["TOKENIZERS_PARALLELISM"] = "false"
torch.set_num_threads(1)
torch.set_num_threads = lambda threads: None


def pytest_collection_modifyitems(items):
    if not STATS.exists():
        return
    seconds = json.loads(STATS.read_text())["duration_by_test"]
    items.sort(key=lambda item: seconds.get(item.nodeid, 0.0))


def pytest_collection_finish(session):
    from mutmut.mutation.trampoline import get_mutant_under_test
    from mutmut.state import state

    if get_mutant_under_test() != "stats":
        return
    hits = state()._stats  # what the trampolines recorded since the last test (none has run yet)
    earlier = set(json.loads(IMPORT_TIME.read_text())) if IMPORT_TIME.exists() else set()
    IMPORT_TIME.write_text(json.dumps(sorted(earlier | hits), indent=0))
    hits.clear()
