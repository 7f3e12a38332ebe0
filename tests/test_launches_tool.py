"""tools/launches.py, the operator counts docs/benchmarks.md quotes for launch-bound prefills and
decode steps: it runs on any model a user names, counting with the host-sync tests' counter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import own_position_writes
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(\S+)\s+prefill beyond full\s+(-?\d+) .* step beyond full\s+(-?[\d.]+) .*?(, eagerly)?$")


def _rows(model: Path, *options: str) -> dict[str, tuple[int, float, bool]]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "launches.py"), "--model", str(model), "--length", "64", *options,
         "full", "snapkv", "streamingllm", "tova", "sliminfer"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {}
    for line in done.stdout.splitlines():
        if match := ROW.match(line):
            name, prefill, step, eagerly = match.groups()
            rows[name] = (int(prefill), float(step), eagerly is not None)
    return rows


@pytest.mark.processes
@pytest.mark.parametrize("graphs", [False, True])
def test_the_launch_counts_of_each_method_beyond_fulls(tiny_folder, graphs):
    """Full is 0 beyond itself; SnapKV scores its prefill, then it and StreamingLLM decode as full
    does but for their layers' positions: a compressed layer holds its own, which it writes, where
    full's layers share one write (``KVCache._append_positions``; the static cache writes every
    layer's, full's too); TOVA scores and evicts at every step, in the graph too; so does SlimInfer
    score, its graph in parts."""
    rows = _rows(tiny_folder, *(["--cuda-graphs"] if graphs else []))
    assert rows["full"] == (0, 0.0, False)
    layers = AutoConfig.from_pretrained(tiny_folder).num_hidden_layers
    own_positions = float(own_position_writes(layers, graphs))
    assert rows["snapkv"][0] > 0 and rows["snapkv"][1:] == (own_positions, False)
    assert rows["streamingllm"][1:] == (own_positions, False)
    assert rows["tova"][1] > 0 and not rows["tova"][2]
    assert rows["sliminfer"][1] > 0 and not rows["sliminfer"][2]
