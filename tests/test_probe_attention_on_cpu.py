"""benchmarks/probe_attention.py at smoke size: reference continuations attend block by block and give the dense
mask's log-probs; exit probes stay dense."""

import pytest

from benchmarks import probe_attention


def test_probe_attention_smoke(tmp_path):
    result = probe_attention.main(["--smoke", "--out", str(tmp_path / "probe_attention.json")])
    rows = {(row["probes"], row["continuations_per_boundary"]): row for row in result["rows"]}
    for (probes, _), row in rows.items():
        assert row["attends_block_by_block"] == (probes == "references")
        assert row["max_relative_difference"] < 1e-5
        assert row["block_by_block_over_dense"] == pytest.approx(row["block_by_block_s"] / row["dense_s"])
    # more continuations a boundary, more tree tokens
    assert [rows["references", c]["tree_tokens_per_trace"] for c in (1, 2, 3)] == sorted(
        rows["references", c]["tree_tokens_per_trace"] for c in (1, 2, 3))
