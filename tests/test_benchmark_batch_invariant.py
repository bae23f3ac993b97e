"""benchmarks/batch_invariant.py --quick runs both modes side by side and writes JSON + plot."""

from __future__ import annotations

import json


def test_batch_invariant_benchmark_quick(tmp_path):
    from benchmarks.batch_invariant import main

    result = main(quick=True, out_dir=tmp_path)
    saved = json.loads((tmp_path / "batch_invariant.json").read_text())
    assert (tmp_path / "batch_invariant.png").stat().st_size > 0
    for what in ("decode", "prefill", "grpo"):
        w = saved["workloads"][what]
        assert w["default"]["tokens"] == w["invariant"]["tokens"] > 0
        assert w["ratio_invariant_over_default"] > 0
    assert saved["workloads"] == json.loads(json.dumps(result["workloads"]))
