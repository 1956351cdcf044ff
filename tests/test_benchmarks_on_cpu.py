"""The benchmarks' smoke modes (seconds, no verl training) and the offline Monte-Carlo value tool."""

import json
import math
from pathlib import Path

import pytest
import torch
from scipy import stats

from benchmarks import (
    common,
    gpu_projection,
    items_prototype,
    length_scaling,
    sample_efficiency,
    value_gate,
    value_pass,
    value_quality,
    verdict,
)
from benchmarks.common import build_task, continuation_success_rates, spearman
from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.runs import load_metrics
from rredcot_verl.tasks import compute_score, load_model_dir, parse_prompt, reference_response
from rredcot_verl.tasks.arithmetic import response_step_lines
from rredcot_verl.tasks.model import chat_prompt_ids, response_ids

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MACHINE_KEYS = {"torch", "transformers", "machine", "python"}  # the machine that wrote a JSON, not its results


def assert_same_result(recomputed, committed, path="") -> None:
    """Equal keys, lists and strings, and numbers equal to 1e-9 relative (last-bit differences of another order of
    summation); the writing machine's versions left out."""
    if isinstance(committed, dict):
        keys = set(committed) - (MACHINE_KEYS if path.endswith("meta") else set())
        assert set(recomputed) - (MACHINE_KEYS if path.endswith("meta") else set()) == keys, path
        for key in keys:
            assert_same_result(recomputed[key], committed[key], f"{path}.{key}")
    elif isinstance(committed, list):
        assert len(recomputed) == len(committed), path
        for i, (x, y) in enumerate(zip(recomputed, committed)):
            assert_same_result(x, y, f"{path}[{i}]")
    elif isinstance(committed, float) and isinstance(recomputed, (int, float)):
        assert math.isclose(recomputed, committed, rel_tol=1e-9, abs_tol=1e-12), path
    else:
        assert recomputed == committed, path


@torch.no_grad()
def exact_success_probability_two_tokens(model, tokenizer, prompt: list[int], prefix: list[int], ground_truth: str,
                                         temperature: float = 1.0) -> float:
    """Exact P(success) of a prefix's continuation with a budget of two tokens: success needs EOS as the second
    token after a first token t whose text makes the reward 1 (EOS first ends the response at the prefix itself).
    p = Σ_t p(t) · p(EOS | t) · [reward(t) = 1] + p(EOS) · [reward(prefix) = 1], from exact softmaxes."""
    eos = tokenizer.eos_token_id
    context = torch.tensor([list(prompt) + list(prefix)])
    first = (model(input_ids=context).logits[0, -1].float() / temperature).softmax(-1)
    probability = float(first[eos]) * compute_score(None, tokenizer.decode(prefix, skip_special_tokens=True),
                                                    ground_truth)
    for token in range(first.numel()):
        text = tokenizer.decode(list(prefix) + [token], skip_special_tokens=True)
        if token == eos or compute_score(None, text, ground_truth) == 0.0:
            continue
        extended = torch.cat([context, torch.tensor([[token]])], dim=1)
        second = (model(input_ids=extended).logits[0, -1].float() / temperature).softmax(-1)
        probability += float(first[token]) * float(second[eos])
    return probability


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    torch.set_num_threads(1)
    return build_task(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="module")
def model_and_tokenizer(build):
    model, tokenizer = load_model_dir(str(build / "model"))
    return model.eval(), tokenizer


def _trace(prompt: list[int], response: list[int], truth: str) -> common.Trace:
    return common.Trace(None, torch.tensor(prompt), torch.tensor(response), "", 0.0, 0, truth, [])


def test_monte_carlo_matches_the_exact_probability_of_a_forced_answer(model_and_tokenizer):
    """State S_1 = the correct trace up to the last answer digit; two tokens of budget leave "}" + EOS (or an
    equivalent) as the only successes. At temperature 3 the exact probability is moderate, so the check is sharp."""
    model, tokenizer = model_and_tokenizer
    problem = parse_prompt("Compute 96-79+5+97")
    prompt = chat_prompt_ids(tokenizer, problem.prompt)
    response = response_ids(tokenizer, reference_response(problem))
    prefix = response[:-2]  # drop "}" and EOS
    assert tokenizer.decode(prefix).endswith("\\boxed{119")
    temperature, samples = 3.0, 400
    exact = exact_success_probability_two_tokens(model, tokenizer, prompt, prefix, str(problem.answer), temperature)
    assert 0.1 < exact < 0.9
    trace = _trace(prompt, response, str(problem.answer))
    (values,), _ = continuation_success_rates(model, tokenizer, [trace], [[len(prefix), len(response)]],
                                      num_samples=samples, max_response_tokens=len(prefix) + 2,
                                      temperature=temperature, seed=3)
    assert abs(values[1] - exact) <= 4 * math.sqrt(exact * (1 - exact) / samples)  # 4 binomial sigmas
    # One token of budget cannot hold "}" and EOS: every continuation is truncated and counts as a failure.
    (values,), _ = continuation_success_rates(model, tokenizer, [trace], [[len(prefix), len(response)]], num_samples=16,
                                      max_response_tokens=len(prefix) + 1)
    assert values[1] == 0.0


def test_monte_carlo_gives_a_state_without_room_no_value(model_and_tokenizer):
    """A state whose prefix already fills the response budget gets no continuations and a NaN value; the others are
    valued from ``num_samples`` continuations each (success counts over num_samples)."""
    model, tokenizer = model_and_tokenizer
    trace = _trace([1, 2], [3, 4, 5, 6], "1")
    (values,), generated = continuation_success_rates(model, tokenizer, [trace], [[2, 3, 4]], num_samples=4,
                                              max_response_tokens=3)
    assert math.isnan(values[2]) and not any(math.isnan(v) for v in values[:2])
    assert all((v * 4).is_integer() for v in values[:2])
    assert 4 * (1 + 1) <= generated <= 4 * (3 + 1)  # S_0: 1..3 tokens (EOS included), S_1: 1


def test_spearman_uses_average_ranks_and_rejects_constant_series():
    assert spearman([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def test_value_quality_smoke(build, tmp_path):
    result = value_quality.main(["--smoke", "--build", str(build), "--out", str(tmp_path / "vq.json")])
    written = json.loads((tmp_path / "vq.json").read_text())
    assert written["traces"]["n"] == 4 and written["traces"]["states"] > 4
    assert set(written["states"]) == {*value_quality.PROBE_SOURCES, "rule"}
    assert set(written["segments"]) == {*value_quality.PROBE_SOURCES, "rule", "loo", "grad_x_input", "mc"}
    samples = written["meta"]["mc_samples"]
    for trace in result["per_trace"]:
        assert len(trace["mc"]) == len(trace["segment_ends"]) == len(trace["loo"]) == len(trace["rule"])
        assert all((v * samples).is_integer() for v in trace["mc"])  # success counts over the samples
        assert trace["rule"][0] == 1.0  # nothing written yet at S_0
    assert any(len(set(trace["reference"])) > 1 for trace in result["per_trace"])
    # The tables recomputed from the stored per-trace records are the run's own.
    recomputed = value_quality.main(["--from-json", str(tmp_path / "vq.json"), "--out", str(tmp_path / "re.json")])
    assert_same_result(json.loads((tmp_path / "re.json").read_text()), written)
    assert recomputed["states"] == result["states"] and recomputed["segments"] == result["segments"]


def test_value_quality_items_on_another_model_folder(tmp_path):
    """value_quality --setting items --model: the model folder replaces the build's warm start (here the committed
    items artefact itself, so its record's exit accuracy is reproduced), every state records the items left, and the
    result holds the exit accuracy and the goals."""
    from rredcot_verl.tasks.build import PRESETS

    build = build_task(tmp_path / "items", "items")
    model_dir = PRESETS["items"].artefact.model_dir
    result = value_quality.main(["--smoke", "--setting", "items", "--build", str(build), "--model", model_dir,
                                 "--out", str(tmp_path / "vq.json")])
    assert result["meta"]["model"] == model_dir and result["meta"]["setting"] == "items"
    for trace in result["per_trace"]:
        assert trace["steps_left"][0] == 7 and trace["steps_left"] == sorted(trace["steps_left"], reverse=True)
        assert len(trace["steps_left"]) == len(trace["segment_ends"]) <= value_quality.RECIPE_SEGMENTATION.max_segments
    assert {str(left) for left in result["exit_accuracy"]["by_steps_left"]} == {str(left) for left in range(1, 8)}
    assert result["exit_accuracy"]["problems"] == 2 and set(result["goals"]) >= {"exit_raw", "exit_selfnorm"}


def test_long_setting_values_every_line_under_each_reference_alignment(tmp_path):
    """value_quality --setting long on the committed long warm start: every step line is a segment; with the fine
    reference a trace of the reference's step count gets the same values by count and by proportion; the coarse
    reference (two steps a line) is resumed elsewhere by proportion than by count."""
    assert value_quality.coarse_steps(["7-1=6 +5+9", "6+5=11 +9", "11+9=20"]) == ["7-1+5=11 +9", "11+9=20"]
    build = build_task(tmp_path / "long", "long")
    model, tokenizer = load_model_dir(str(build / "model"))
    model.eval()
    problems = common.load_problems(build / "data" / "val.parquet", 2)
    traces = common.sample_traces(model, tokenizer, problems, 2, seed=0,
                                  max_response_tokens=common.SETTINGS["long"].max_response_length)
    ends, values, _ = value_quality.value_sources(model, tokenizer, traces, value_quality.LONG_PROBE_SOURCES,
                                                  value_quality.LONG_SEGMENTATION)
    for i, trace in enumerate(traces):
        lines = response_step_lines(trace.text) or []
        assert len(ends[i]) >= min(len(lines), value_quality.LONG_SEGMENTATION.max_segments)
        if len(lines) == trace.problem.num_steps:
            assert values["reference_proportional"][i].tolist() == values["reference"][i].tolist()
    assert any(values["coarse_reference_proportional"][i].tolist() != values["coarse_reference_steps"][i].tolist()
               for i in range(len(traces)))


def test_length_scaling_reads_each_roles_gradient_result_where_the_protocol_wrote_it(tmp_path):
    """The length table's gain columns are the protocol's own numbers: IBPO's resumed repairs from the operator
    comparison at the default and hard lengths, every role from the long protocol at the long length."""
    result = length_scaling.main(["--smoke", "--out", str(tmp_path / "ls.json")])
    hard = json.loads((RESULTS / "ibpo_operators_hard.json").read_text())["methods"]["ibpo_resume"]["batches"]["128"]
    entry = result["lengths"]["hard"]["gradient"]["ibpo"]
    assert entry["method"] == "ibpo_resume" and entry["source"].endswith("ibpo_operators_hard.json")
    assert entry["cosine_minus_grpo"] == hard["cosine_minus_grpo_mean"]
    assert result["lengths"]["default"]["gradient"]["best_without_references"]["method"] == \
        "rredcot_repairs_degenerate"  # the committed rewrite-operator result, named as such
    long = result["lengths"]["long"]["gradient"]
    assert {entry["method"] for entry in long.values()} == set(length_scaling.ROLES.values())
    if (RESULTS / "gradient_quality_long.json").exists():
        assert all(entry["source"] is not None for entry in long.values())


def test_values_by_steps_left_split_right_and_wrong_prefixes():
    """The answer-early table: states grouped by the steps left after them, apart before and after a wrong line."""
    traces = [{"steps_left": [2, 2, 1, 0], "rule": [1.0, 1.0, 1.0, 1.0], "exit_raw": [0.1, 0.1, 0.5, 1.0],
               "exit_selfnorm": [0.3, 0.3, 0.9, 1.0], "mc": [0.4, 0.5, 0.75, 1.0]},
              {"steps_left": [2, 2, 1, 0], "rule": [1.0, 1.0, 0.0, 0.0], "exit_raw": [0.1, 0.1, 0.01, None],
               "exit_selfnorm": [0.5, 0.5, 0.1, 0.0], "mc": [0.2, 0.3, 0.0, 0.0]}]
    table = value_quality.by_steps_left(traces)
    assert table["right"][2] == {"n": 4, "exit_raw": pytest.approx(0.1), "exit_selfnorm": pytest.approx(0.4),
                                 "mc": pytest.approx(0.35)}
    assert table["right"][1]["mc"] == 0.75 and table["right"][0]["n"] == 1
    assert table["wrong"][1] == {"n": 1, "exit_raw": 0.01, "exit_selfnorm": 0.1, "mc": 0.0}
    assert math.isnan(table["wrong"][0]["exit_raw"])  # no estimate there: not a zero


@pytest.mark.parametrize("name", ["value_quality.json", "value_quality_long.json", "value_quality_early.json"])
def test_committed_value_quality_json_recomputes_from_its_per_trace_records(tmp_path, name):
    committed = json.loads((RESULTS / name).read_text())
    value_quality.main(["--from-json", str(RESULTS / name), "--out", str(tmp_path / "vq.json")])
    assert_same_result(json.loads((tmp_path / "vq.json").read_text()), committed)


@pytest.mark.parametrize("setting, argv", [
    ("default", ["--timing-seeds", "3", "--methods", "grpo", "rredcot", "rredcot_exit_probe", "rredcot_group",
                 "rredcot_ground_truth", "ibpo", "segment_mc"]),
    ("hard", ["--timing-seeds", "1"]),
    ("long", []),
])
def test_committed_sample_efficiency_jsons_recompute_from_the_ledger(tmp_path, setting, argv):
    """The committed JSONs are what the committed ledger gives (RESULTS.md §3 names the commands)."""
    name = "sample_efficiency.json" if setting == "default" else f"sample_efficiency_{setting}.json"
    sample_efficiency.main(["--setting", setting, "--from-runs", *argv, "--out", str(tmp_path / name)])
    assert_same_result(json.loads((tmp_path / name).read_text()), json.loads((RESULTS / name).read_text()))


@pytest.mark.parametrize("registration", sorted((RESULTS.parent / "registrations").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_committed_verdict_jsons_recompute_from_the_ledger(tmp_path, registration):
    """Every registration's JSON (results/<name>.json) is what ``benchmarks.verdict`` gives from the committed ledger;
    a registration none of whose runs is in the ledger yet has no JSON to check."""
    loaded = verdict.load_registration(registration)
    committed = RESULTS / f"{loaded.name}.json"
    runs = verdict.registered_runs(loaded, verdict.LEDGER_DIR)
    if not committed.exists() and not any(arm["runs"] or arm["not_as_registered"] for arm in runs.values()):
        pytest.skip(f"{registration.name}: no run in the ledger yet")
    verdict.main([str(registration), "--out", str(tmp_path / committed.name)])
    assert_same_result(json.loads((tmp_path / committed.name).read_text()), json.loads(committed.read_text()))


def test_committed_gpu_projection_and_long_step_cost_recompute_from_their_inputs(tmp_path):
    """Both JSONs are what ``benchmarks.gpu_projection`` gives from the committed gpu_check, driver_share, paper
    recipes, ledger, length_scaling and long-setting stage medians (pure arithmetic): a regenerated input shows here
    until the projection is regenerated too."""
    gpu_projection.main(["--out", str(tmp_path / "gpu.json"), "--long-out", str(tmp_path / "long.json")])
    assert_same_result(json.loads((tmp_path / "gpu.json").read_text()),
                       json.loads((RESULTS / "gpu_projection.json").read_text()))
    assert_same_result(json.loads((tmp_path / "long.json").read_text()),
                       json.loads((RESULTS / "long_step_cost.json").read_text()))


def test_gpu_projection_scales_the_measured_passes_to_the_recipes_traces_per_gpu():
    """The log-prob stage is the recipe's traces per GPU times gpu_check's measured pass at the recipe's length
    (the fit goes through it within 0.5%), every estimator adds to GRPO's stages, and each range holds its
    central ratio."""
    projection = gpu_projection.gpu_projection(gpu_projection.collect_inputs())
    shape, measured = projection["inputs"]["shape"], projection["inputs"]["gpu_check"]["passes"]["plain"]["measured"]
    assert (shape["traces"], shape["gpus"], shape["response_tokens"]) == (512, 8, 25000)
    per_trace = measured[str(gpu_projection.ASSUMPTIONS["prompt_tokens"]["value"] + shape["response_tokens"])]
    grpo = projection["estimators"]["grpo"]
    assert grpo["stages_s"]["old_log_prob"] == pytest.approx(64 * per_trace, rel=5e-3)
    for name, entry in projection["estimators"].items():
        low, high = entry["over_grpo_range"]
        assert low <= entry["over_grpo"] <= high, name
        assert all(entry["stages_s"][stage] == grpo["stages_s"][stage] for stage in grpo["stages_s"]), name
        assert entry["step_s"] >= grpo["step_s"], name


def test_long_setting_stage_medians_are_read_from_each_runs_metrics(tmp_path):
    run = tmp_path / "grpo_seed1"
    run.mkdir()
    rows = [(1, {"timing_s/step": 50.0, "timing_s/gen": 40.0, "response_length/mean": 300.0}),
            (2, {"timing_s/step": 6.0, "timing_s/gen": 3.0, "response_length/mean": 390.0}),
            (3, {"timing_s/step": 8.0, "timing_s/gen": 4.0, "response_length/mean": 400.0})]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in rows))
    assert gpu_projection.extract_stage_medians(tmp_path) == {
        "grpo_seed1": {"phase_median_s": {"gen": 3.5, "step": 7.0}, "steps": 3, "response_length_median": 390.0}}


def test_t_interval_is_scipys_and_a_constant_sample_has_zero_width():
    sample = [0.21, 0.35, 0.28, 0.30]
    expected = stats.t.interval(0.95, len(sample) - 1, loc=sum(sample) / 4, scale=stats.sem(sample))
    assert common.t_interval(sample) == pytest.approx(list(expected))
    assert common.t_interval([0.4, 0.4, 0.4]) == pytest.approx([0.4, 0.4], abs=1e-15)
    assert common.t_interval([0.4]) is None
    assert common.mean_interval([0.2, None, 0.4]) == {"mean": pytest.approx(0.3), "ci95": pytest.approx(
        list(stats.t.interval(0.95, 1, loc=0.3, scale=stats.sem([0.2, 0.4])))), "sd": pytest.approx(0.1414, abs=1e-4),
                                                     "n": 2}


def test_paired_differences_of_identical_runs_are_zero_with_a_zero_width_interval():
    runs = {"1": 0.31, "2": 0.42, "3": 0.28}
    assert common.paired_differences(runs, dict(runs)) == [0.0, 0.0, 0.0]
    assert common.t_interval(common.paired_differences(runs, dict(runs))) == [0.0, 0.0]
    # Only the keys both have are paired, in key order.
    assert common.paired_differences({"1": 0.5, "2": 0.7}, {"2": 0.4, "3": 0.9}) == [pytest.approx(0.3)]


def test_value_gate_smoke_decides_as_the_gate_would(build, tmp_path):
    result = value_gate.main(["--smoke", "--build", str(build), "--out", str(tmp_path / "vg.json"), "--runs"])
    part = json.loads((tmp_path / "vg.json").read_text())["warm_start"]["default"]
    assert set(part["sources"]) == {*value_gate.SOURCES, value_gate.RANDOM_CONTROL}
    threshold = f"{result['threshold']:g}"
    for name, row in part["sources"].items():
        assert row["comparisons_per_batch"] > 0, name  # 2 x 4 traces at the warm start's ~35% have mixed groups
        concordance = row["concordance"]["mean"]
        # One batch: its concordance is the window's, so the mean over batches equals the pooled counts' ratio.
        assert row["concordance"]["n"] == 1 and concordance == pytest.approx(row["concordance_pooled"])
        # One batch: the gate is open exactly when its own concordance reaches the threshold, whatever the window.
        for window in row["gate_open_share"].values():
            assert window[threshold] == float(concordance >= result["threshold"])
        if row["localisation_traces"]:
            hits = row["localisation"] * row["localisation_traces"]  # a share of the scored traces
            assert hits == pytest.approx(round(hits)) and 0.0 < row["localisation_chance"] <= 0.5  # K >= 2 each


def test_localisation_hit_by_hand():
    """A hit when the most negative segment reward lies on the segment holding the first wrong step; chance 1/K
    over the segment rewards that are not padding; None where there is nothing to score."""
    hit = common.localisation_hit
    assert hit([0.2, -0.5, 0.1], 1) == (1.0, pytest.approx(1 / 3))
    assert hit([0.2, -0.5, 0.1], 2) == (0.0, pytest.approx(1 / 3))
    assert hit([-0.1, 0.3, None, float("nan")], 0) == (1.0, 0.5)  # padding and fallback entries are not segments
    assert hit([0.2, -0.5, 0.1], None) is None and hit([-0.5], 0) is None and hit([0.2, -0.5], 2) is None


def test_value_gate_replay_pools_the_window_like_the_trainer():
    counts = [ConcordanceCounts(0.0, 10), ConcordanceCounts(10.0, 10), ConcordanceCounts(10.0, 10), ConcordanceCounts()]
    assert value_gate.replay_gate(counts, 0.6, 1) == [False, True, True, False]  # no comparisons: closed
    assert value_gate.replay_gate(counts, 0.6, 2) == [False, False, True, True]  # 0/10, 10/20, 20/20, 10/10


def test_value_gate_reads_training_snapshots(tmp_path):
    def trace(uid: str, values: list[float], outcome: float) -> dict:
        return {"uid": uid, "outcome": outcome, "seg_ends": [2, 4, 6], "seg_raw_values": [*values, outcome],
                "response_tokens": ["a"] * 6 + ["<|pad|>"] * 2}

    snapshots = tmp_path / "run" / "snapshots"
    snapshots.mkdir(parents=True)
    ordered = [trace("q", [0.5, 0.9, 0.8], 1.0), trace("q", [0.5, 0.2, None], 0.0), trace("r", [0.5, 0.1, 0.1], 1.0)]
    reversed_ = [trace("q", [0.5, 0.1, 0.1], 1.0), trace("q", [0.5, 0.9, 0.9], 0.0)]
    for step, traces in enumerate([ordered, reversed_], start=1):
        (snapshots / f"step_{step:05d}.json").write_text(json.dumps({"step": step, "traces": traces}))
    # Step 1: one pair; shares 10%..90% of 6 tokens read boundary 1 (v = .9 against .2) at 40%..60% and boundary 2
    # at 70%..90% where the wrong trace has no value: 3 comparisons, all concordant. Group "r" has one trace.
    assert value_gate.snapshot_counts(json.loads((snapshots / "step_00001.json").read_text())) == ConcordanceCounts(3.0, 3)
    run = value_gate.training_run(tmp_path / "run")
    assert run["steps"] == 2 and run["concordance"]["first"] == pytest.approx(3 / 9)  # step 2: 6 discordant
    assert run["gate_open_share"]["window 1"]["0.6"] == 0.5


def test_cost_smoke(build, tmp_path):
    result = value_pass.main(["values", "--smoke", "--build", str(build), "--out", str(tmp_path / "cost.json")])
    methods = result["values"]["methods"]
    assert set(methods) == {"packed", "naive", "mc_k9", "recipe_values"}
    assert result["values"]["max_abs_logp_diff_packed_vs_naive"] < 1e-3  # same probes, same scores
    assert methods["naive"]["tokens"] > methods["packed"]["tokens"]
    assert methods["mc_k9"]["tokens"] > methods["naive"]["tokens"]
    assert "training" not in result
    assert json.loads((tmp_path / "cost.json").read_text())["values"]["states"] == result["values"]["states"]


def test_cost_training_block_reads_runs_as_committed(tmp_path):
    """``value_pass values --runs-dir``: each method's run is read (a cut-short last line dropped), its median step
    over steps >= 2 set over GRPO's, with the keys of the committed cost.json."""
    for offset, method in enumerate(("grpo", "rredcot", "segment_mc", "ibpo")):
        rows = [(step, {"timing_s/step": 50.0 if step == 1 else 2.0 + offset + step, "timing_s/gen": 1.0})
                for step in (1, 2, 3, 4, 5)]
        (tmp_path / f"{method}_seed1").mkdir()
        _write_launch(tmp_path / f"{method}_seed1" / "metrics.jsonl", rows, cut_last_line=True)

    training = value_pass.measure_training(tmp_path, 3, 1, tmp_path, launch=False)

    committed = json.loads((RESULTS / "cost.json").read_text())["training"]
    assert {method: list(entry) for method, entry in training.items()} == {
        method: list(entry) for method, entry in committed.items()}
    assert [training[m]["median_step_s"] for m in training] == [5.0, 6.0, 7.0, 8.0]
    assert training["ibpo"]["over_grpo"] == 8.0 / 5.0 and training["grpo"]["steps_used"] == 3


def test_step_times_skip_the_warm_up_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "data": {"timing_s/step": t}}) + "\n"
                            for s, t in [(1, 50.0), (2, 4.0), (3, 6.0)]))
    assert common.step_seconds(load_metrics(path)) == [4.0, 6.0]
    assert common.median_step_s(load_metrics(path)) == 5.0


def test_phase_medians_skip_the_warm_up_step_and_absent_phases(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [(1, {"timing_s/step": 50.0, "timing_s/gen": 40.0}), (2, {"timing_s/step": 4.0, "timing_s/gen": 1.0}),
            (3, {"timing_s/step": 6.0, "timing_s/gen": 3.0, "timing_s/testing": 9.0}), (4, {"timing_s/step": 7.0})]
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in rows))
    assert common.phase_medians(load_metrics(path)) == {"gen": 2.0, "step": 6.0, "testing": 9.0}


def test_sample_efficiency_smoke_reads_synthetic_runs(tmp_path):
    result = sample_efficiency.main(["--smoke", "--out", str(tmp_path / "se.json")])
    methods = result["methods"]
    assert set(methods) == set(sample_efficiency.METHODS)
    # Sweep: the second rate learns fastest (slope 0.02 vs 0.01 over 4 steps, validated at 0, 2, 4).
    chosen = sample_efficiency.SWEEP_LRS[1]
    assert all(entry["lr"] == chosen for entry in result["sweep"].values())
    # segment_mc has no sweep runs of its own: it takes rredcot's rate.
    assert result["sweep"]["segment_mc"] == {"lr": chosen, "auc_by_lr": None, "lr_from": "rredcot"}
    assert not list((Path(result["meta"]["runs_dir"]) / "sweep").glob("segment_mc_*"))
    assert result["sweep"]["grpo"]["auc_by_lr"][f"{chosen:g}"] == pytest.approx(0.3 + 0.02 * 2)
    # Main: accuracy 0.01·(m+1)·step + 0.3 + 0.001·seed, seeds 1 and 2, validated at steps 0, 2, 4, 6; GRPO is m = 0.
    assert result["grpo_final_accuracy"] == pytest.approx(0.3 + 0.01 * 6 + 0.0015)
    assert result["grpo_steps_to_final"] == 6
    rredcot, grpo = methods["rredcot"], methods["grpo"]
    assert rredcot["steps_to_grpo_final"] == 4
    assert rredcot["steps_to_grpo_final_over_grpo"] == pytest.approx(4 / 6)
    assert rredcot["seconds_to_grpo_final"] == pytest.approx(4 * 6.0)  # m = 1: 6 s a step
    assert grpo["final_seconds"] == pytest.approx(6 * 5.0)  # cumulative timing_s/step, not testing
    assert grpo["median_step_s"] == pytest.approx(5.0)
    assert grpo["grad_norm_variance"] == pytest.approx(0.0025)
    assert [p["step"] for p in grpo["curve"]] == [0, 2, 4, 6]
    # A linear curve's normalised AUC is its mid-point value.
    assert grpo["auc"] == pytest.approx(0.3 + 0.01 * 3 + 0.0015)
    assert rredcot["auc"] == pytest.approx(0.3 + 0.02 * 3 + 0.0015)
    assert grpo["seeds"] == [1, 2] and grpo["steps"] == 6 and grpo["val_size"] == 1000 and grpo["lr"] == chosen
    # Seed-level t interval: seeds differ by 0.001 → sd 0.000707, half-width t(0.975, 1)·sd/√2 = 12.706·0.0005.
    last = grpo["curve"][-1]
    low, high = last["ci95_seeds"]
    assert (high - low) / 2 == pytest.approx(12.706 * 0.0005, rel=1e-3)
    seeds = [0.3 + 0.01 * 6 + 0.001 * seed for seed in (1, 2)]
    assert [low, high] == pytest.approx(list(stats.t.interval(0.95, 1, loc=sum(seeds) / 2, scale=stats.sem(seeds))))
    # Binomial interval of the mean of two runs at p ≈ 0.36 on 1000 problems: 1.96·√(Σ p(1−p)/1000)/2.
    low, high = last["ci95_binomial"]
    p1, p2 = 0.361, 0.362
    assert (high - low) / 2 == pytest.approx(1.96 * ((p1 * (1 - p1) + p2 * (1 - p2)) / 1000) ** 0.5 / 2)
    assert result["meta"]["setting"] == "default" and result["meta"]["setting_parameters"]["task"]["max_operands"] == 6
    # Diagnostics: train reward 0.3 + 0.01·step over steps 1..6 (fewer than the 10-step window: both windows are all).
    assert grpo["diagnostics"]["first"]["critic/score/mean"] == pytest.approx(0.3 + 0.01 * 3.5)
    assert rredcot["diagnostics"]["last"]["critic/score/mean"] == pytest.approx(0.3 + 0.02 * 3.5)
    assert grpo["localisation"] is None  # synthetic runs write no snapshots
    # Paired by seed, the seed offset cancels: rredcot gains 0.01 a step more than grpo over steps 0..6.
    paired = rredcot["paired_with_grpo"]
    assert paired["seeds"] == 2 and paired["up_to_step"] == 6 and grpo["paired_with_grpo"] is None
    assert paired["auc_difference"] == pytest.approx(0.01 * 3)
    assert paired["auc_difference_ci95"] == pytest.approx([0.03, 0.03])
    assert paired["final_difference"] == pytest.approx(0.01 * 6)
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_sample_efficiency_hard_setting_takes_the_default_settings_sweep(tmp_path):
    result = sample_efficiency.main(["--smoke", "--setting", "hard", "--out", str(tmp_path / "se_hard.json")])
    runs_dir = Path(result["meta"]["runs_dir"])
    assert runs_dir.name == "hard" and result["meta"]["sweep_setting"] == "default"
    assert not (runs_dir / "sweep").exists()
    swept = sorted(path.name for path in (runs_dir.parent / "default" / "sweep").iterdir())
    assert "grpo_lr3e-05" in swept and len(swept) == 6 * len(sample_efficiency.SWEEP_LRS)
    assert all(entry["lr"] == sample_efficiency.SWEEP_LRS[1] for entry in result["sweep"].values())
    assert result["meta"]["setting_parameters"]["task"]["min_operands"] == 5
    # The study's methods and the controls: GRPO with 1.5x and 2.5x the rollouts a prompt, at GRPO's rate.
    assert set(result["methods"]) == {*sample_efficiency.METHODS, "grpo_n6", "grpo_n10"}
    assert result["sweep"]["grpo_n10"]["lr_from"] == "grpo"
    record = json.loads((runs_dir / "main" / "grpo_n10_seed1" / sample_efficiency.RUN_RECORD).read_text())
    assert "actor_rollout_ref.rollout.n=10" in record["overrides"]


def _snapshot_trace(response: str, segment_rewards: list[float], outcome: float) -> dict:
    """A snapshot trace of the embedded task: one token per character but for the think tags, a segment per line."""
    tokens = []
    for piece in response.replace("<think>", "\0<think>\0").replace("</think>", "\0</think>\0").split("\0"):
        tokens += [piece] if piece in ("<think>", "</think>") else list(piece)
    seg_ends = [i + 1 for i, token in enumerate(tokens) if token == "\n"] + [len(tokens)]
    return {"response": response, "response_tokens": tokens + ["<|pad|>"] * 3, "outcome": outcome,
            "seg_ends": seg_ends + [-1] * (8 - len(seg_ends)), "segment_rewards": segment_rewards,
            "extra_info": {"operands": [48, 57, 46], "ops": ["-", "+"]}}


def test_sample_efficiency_localisation_finds_the_segment_of_the_first_wrong_step(tmp_path):
    wrong_second_line = "<think>\n48-57=-9\n-9+46=36\n</think>\n\\boxed{36}"
    missing_second_line = "<think>\n48-57=-9\n</think>\n\\boxed{-9}"
    # Segments: "<think>\n", one per step line, "</think>\n", the answer.
    hit = _snapshot_trace(wrong_second_line, [0.0, 0.1, -0.5, 0.0, 0.0], 0.0)
    miss = _snapshot_trace(wrong_second_line, [0.0, -0.5, 0.1, 0.0, 0.0], 0.0)
    missing = _snapshot_trace(missing_second_line, [0.0, 0.2, -0.4, 0.0], 0.0)  # blame lands on "</think>\n"
    assert [sample_efficiency.blamed_segment(t) for t in (hit, miss, missing)] == [2, 2, 2]
    correct = _snapshot_trace("<think>\n48-57=-9\n-9+46=37\n</think>\n\\boxed{37}", [0.0, 0.3, 0.2, 0.0, 0.0], 1.0)
    assert sample_efficiency.blamed_segment(correct) is None
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    for step, traces in enumerate([[hit, correct], [miss, missing]], start=1):
        (snapshots / f"step_{step:05d}.json").write_text(json.dumps({"step": step, "traces": traces}))
    result = sample_efficiency.snapshot_localisation(sample_efficiency.read_snapshots(tmp_path))  # both steps lie in both 10-step windows
    assert result["first"] == {"localisation": pytest.approx(2 / 3), "chance": pytest.approx((1 / 5 + 1 / 5 + 1 / 4) / 3),
                               "traces": 3}
    grpo_like = {**hit, "segment_rewards": None}
    (snapshots / "step_00001.json").write_text(json.dumps({"step": 1, "traces": [grpo_like]}))
    (snapshots / "step_00002.json").write_text(json.dumps({"step": 2, "traces": [grpo_like]}))
    assert sample_efficiency.snapshot_localisation(sample_efficiency.read_snapshots(tmp_path)) is None


def test_sample_efficiency_ledger_resumes_a_study_on_another_machine(tmp_path):
    """A finished run is recorded in the ledger; another checkout (other runs root, run folder gone) reads it and
    launches nothing, and a run recorded under other settings is not taken for it."""
    se = sample_efficiency
    first_root, second_root, ledger_dir = tmp_path / "a" / "runs", tmp_path / "b" / "runs", tmp_path / "ledger"

    def spec(runs_root: Path, lr: float = 3e-5) -> se.RunSpec:
        out = se.main_dir(runs_root / "default", "grpo", 1)
        return se.RunSpec("grpo", 1, 6, lr, (f"data.train_files={runs_root}/default/data_main/train.parquet",
                                             *se.checkpoint_overrides(out, 2)))

    out = se.main_dir(first_root / "default", "grpo", 1)
    se.write_synthetic_metrics(out, 0.01, 1, 6, 2, 5.0)
    (out / se.RUN_RECORD).write_text(json.dumps(spec(first_root).record()))
    recorded = se.Ledger(ledger_dir, first_root).summary(out, spec(first_root))
    assert recorded["source"] == "metrics" and recorded["auc"] == pytest.approx(0.3 + 0.01 * 3 + 0.001)
    assert (ledger_dir / "default" / "main" / "grpo_seed1.json").exists()
    swept = se.sweep_dir(first_root / "default", "grpo", 1e-4)
    assert se.Ledger(ledger_dir, first_root).path(swept) == ledger_dir / "default" / "sweep" / "grpo_lr0.0001.json"

    elsewhere = se.Ledger(ledger_dir, second_root)
    moved_out = se.main_dir(second_root / "default", "grpo", 1)
    assert not moved_out.exists()
    assert elsewhere.summary(moved_out, spec(second_root)) == recorded
    assert se.ensure_run(moved_out, spec(second_root), tmp_path / "no-build", elsewhere) == 0
    assert not moved_out.exists()  # nothing was launched
    assert elsewhere.summary(moved_out, spec(second_root, lr=1e-5)) is None


def test_sample_efficiency_pairs_a_shorter_run_with_grpo_on_the_steps_both_have():
    def run(accuracies):
        return {"validation": [{"step": 10 * i, "seconds": None, "accuracy": a} for i, a in enumerate(accuracies)]}

    grpo = {"1": run([0.5, 0.6, 0.7, 0.8]), "2": run([0.5, 0.5, 0.6, 0.6]), "3": run([0.5, 0.6])}
    short = {"1": run([0.5, 0.7, 0.7]), "2": run([0.5, 0.6, 0.6])}  # seed 3 missing: not paired
    paired = sample_efficiency.paired_with_grpo(short, grpo)
    assert paired["seeds"] == 2 and paired["up_to_step"] == 20
    # Over steps 0..20 seed 1 differs by (0, +0.1, 0) and seed 2 by (0, +0.1, 0): AUC +0.05 each, final 0 each.
    assert paired["auc_difference"] == pytest.approx(0.05)
    assert paired["final_difference"] == pytest.approx(0.0)
    assert sample_efficiency.paired_with_grpo({"4": run([0.5, 0.6])}, grpo) is None


def test_sample_efficiency_training_seconds_come_from_the_timing_seeds_only(tmp_path):
    se = sample_efficiency
    runs_root = tmp_path / "runs"
    ledger = se.Ledger(tmp_path / "ledger", runs_root)
    specs = {"grpo": []}
    for seed, step_s in ((1, 50.0), (2, 5.0)):  # seed 1 ran on a day the machine was 10x slower
        spec = se.RunSpec("grpo", seed, 6, 3e-5, ("trainer.test_freq=2",))
        out = se.main_dir(runs_root / "default", "grpo", seed)
        se.write_synthetic_metrics(out, 0.01, seed, 6, 2, step_s)
        (out / se.RUN_RECORD).write_text(json.dumps(spec.record()))
        specs["grpo"].append(spec)
    every = se.analyse(runs_root / "default", specs, 1000, ledger)["methods"]["grpo"]
    timed = se.analyse(runs_root / "default", specs, 1000, ledger, timing_seeds=[2])["methods"]["grpo"]
    assert every["median_step_s"] == pytest.approx(27.5) and every["final_seconds"] == pytest.approx(6 * 27.5)
    assert timed["median_step_s"] == pytest.approx(5.0) and timed["final_seconds"] == pytest.approx(6 * 5.0)
    assert timed["seeds"] == [1, 2]  # accuracy still averages both seeds
    assert [p["accuracy"] for p in timed["curve"]] == [p["accuracy"] for p in every["curve"]]
    # The wall-clock plot names the timing seeds that have runs, not those asked for.
    assert se.timed_seeds({"methods": {"grpo": timed}}) == [2]
    assert se.timed_seeds({"methods": {"grpo": se.analyse(runs_root / "default", specs, 1000, ledger,
                                                          timing_seeds=[1, 2, 3])["methods"]["grpo"]}}) == [1, 2]


def test_sample_efficiency_plot_shades_seed_intervals_from_three_seeds_clipped_to_accuracy_range():
    def entry(seeds, intervals):
        return {"seeds": seeds, "curve": [{"ci95_seeds": interval} for interval in intervals]}

    assert sample_efficiency.seed_band(entry([1, 2], [[-2.0, 3.0], [0.1, 0.9]])) is None
    assert sample_efficiency.seed_band(entry([1, 2, 3], [[0.4, 0.5], None])) is None
    band = sample_efficiency.seed_band(entry([1, 2, 3], [[-0.2, 0.6], [0.5, 1.3]]))
    assert band.tolist() == [[0.0, 0.6], [0.5, 1.0]]


def _write_launch(path: Path, rows: list[tuple[int, dict]], cut_last_line: bool = False) -> None:
    text = "".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in rows)
    path.write_text(text[: text.rstrip().rfind("\n") + 20] if cut_last_line else text)


def test_sample_efficiency_interrupted_launches_merge_into_one_run(tmp_path):
    val = sample_efficiency.VAL_KEYS[0]
    spec = sample_efficiency.RunSpec("grpo", 1, 4, 3e-5, ("trainer.test_freq=2",))
    (tmp_path / sample_efficiency.RUN_RECORD).write_text(json.dumps(spec.record()))
    # Launch 1: validation at 0, steps 1..3 (checkpoint at 2), killed while writing step 3's line.
    _write_launch(tmp_path / "metrics.jsonl", [(0, {val: 0.5}), (1, {"timing_s/step": 1.0}),
                                               (2, {"timing_s/step": 1.0, val: 0.6}), (3, {"timing_s/step": 9.0})],
                  cut_last_line=True)
    (tmp_path / "train.log").write_text("launch 1")
    assert not sample_efficiency.run_complete(tmp_path, spec)
    sample_efficiency.archive_launch(tmp_path)
    assert (tmp_path / "metrics.launch1.jsonl").exists() and (tmp_path / "train.launch1.log").read_text() == "launch 1"
    # Launch 2 resumes from the step-2 checkpoint: validation at 2 again, then steps 3 and 4.
    _write_launch(tmp_path / "metrics.jsonl", [(2, {val: 0.61}), (3, {"timing_s/step": 2.0}),
                                               (4, {"timing_s/step": 2.0, val: 0.7})])
    rows = sample_efficiency.read_run(tmp_path)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert rows[2] == {"step": 2, "timing_s/step": 1.0, val: 0.61}  # launch 1's training, launch 2's validation
    assert rows[3]["timing_s/step"] == 2.0
    assert sample_efficiency.run_complete(tmp_path, spec)
    summary = sample_efficiency.summarise_run(tmp_path)
    assert [(p["step"], p["accuracy"]) for p in summary["validation"]] == [(0, 0.5), (2, 0.61), (4, 0.7)]
    assert summary["validation"][-1]["seconds"] == pytest.approx(6.0)
    # A launch that starts over (no checkpoint) replaces everything after its step 0.
    sample_efficiency.archive_launch(tmp_path)
    _write_launch(tmp_path / "metrics.jsonl", [(0, {val: 0.5}), (1, {"timing_s/step": 3.0})])
    assert [row["step"] for row in sample_efficiency.read_run(tmp_path)] == [0, 1]
    assert not sample_efficiency.run_complete(tmp_path, spec)
    # A broken line that is not the last is an error, not a silent gap.
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "da\n{"step": 1, "data": {}}\n')
    with pytest.raises(json.JSONDecodeError):
        sample_efficiency.read_run(tmp_path)
    # Other settings: the run's files are cleared before it is launched again.
    sample_efficiency.clear_run(tmp_path)
    assert sample_efficiency.launch_files(tmp_path) == [] and not list(tmp_path.glob("train*.log"))


def test_sample_efficiency_main_runs_checkpoint_into_their_own_folder(tmp_path):
    result = sample_efficiency.main(["--smoke", "--out", str(tmp_path / "se.json")])
    runs_dir = Path(result["meta"]["runs_dir"])
    record = json.loads((runs_dir / "main" / "ibpo_seed2" / sample_efficiency.RUN_RECORD).read_text())
    assert f"trainer.default_local_dir={runs_dir / 'main' / 'ibpo_seed2' / 'checkpoints'}" in record["overrides"]
    assert {"trainer.save_freq=2", "trainer.resume_mode=auto"} <= set(record["overrides"])  # smoke: test_freq 2
    sweep_record = json.loads((runs_dir / "sweep" / "ibpo_lr1e-05" / sample_efficiency.RUN_RECORD).read_text())
    assert not any(override.startswith("trainer.save_freq") for override in sweep_record["overrides"])


def test_sample_efficiency_auc_of_a_bent_curve():
    points = [{"step": 0, "accuracy": 0.2}, {"step": 10, "accuracy": 0.6}, {"step": 30, "accuracy": 0.6}]
    # Trapezoids 10·(0.2 + 0.6)/2 = 4 and 20·0.6 = 12 over a span of 30 steps.
    assert common.area_under_curve(points) == pytest.approx(16 / 30)
    assert common.area_under_curve(points[:1]) is None


def test_sample_efficiency_settings_differ_only_in_chain_length():
    default, hard = sample_efficiency.SETTINGS["default"].task, sample_efficiency.SETTINGS["hard"].task
    assert (hard.min_operand, hard.max_operand) == (default.min_operand, default.max_operand)
    assert hard.min_operands > default.min_operands


def _save_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """verl's FSDP checkpoint layout for one rank: the model's and the optimizer's state dicts."""
    folder.mkdir(parents=True)
    torch.save(model.state_dict(), folder / "model_world_size_1_rank_0.pt")
    torch.save(optimizer.state_dict(), folder / "optim_world_size_1_rank_0.pt")


def test_update_norms_read_from_checkpoints_are_the_steps_adamw_took(tmp_path):
    """Without weight decay an AdamW step moves the parameters by exactly lr·m̂/(√v̂ + ε): the norm read from the
    saved moments equals the distance between the checkpoints around that step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(1, 4):
        optimizer.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        optimizer.step()
        if step >= 2:
            _save_checkpoint(tmp_path / "checkpoints" / f"global_step_{step}" / "actor", model, optimizer)
    norms = sample_efficiency.checkpoint_update_norms(tmp_path)
    assert [entry["step"] for entry in norms] == [2, 3] and "moved_since_previous" not in norms[0]
    assert norms[1]["adam_update_norm"] == pytest.approx(norms[1]["moved_since_previous"], rel=1e-4)
    expected = sum(float(p.detach().double().square().sum()) for p in model.parameters()) ** 0.5
    assert norms[1]["parameter_norm"] == pytest.approx(expected)
    assert sample_efficiency.checkpoint_update_norms(tmp_path / "elsewhere") is None


def test_norm_matched_rate_scales_grpos_rate_by_the_update_norm_ratio():
    def run(*norms):
        return {"update_norms": [{"step": 10 * (i + 1), "adam_update_norm": n} for i, n in enumerate(norms)]}

    matched = sample_efficiency.matched_learning_rate(3e-5, run(2.0, 4.0, 3.0), run(6.0, 5.0, 7.0))
    assert matched["update_norm_ratio"] == pytest.approx(0.5) and matched["lr"] == 1.5e-5
    assert sample_efficiency.matched_learning_rate(3e-5, run(1.0), run(3.0))["lr"] == 1e-5  # two significant digits
    assert sample_efficiency.matched_learning_rate(3e-5, run(1.0), {"update_norms": None}) is None
    assert sample_efficiency.matched_learning_rate(3e-5, None, run(1.0)) is None


def test_long_setting_trains_every_method_at_grpos_rate_and_keeps_its_checkpoints(tmp_path):
    se = sample_efficiency
    result = se.main(["--smoke", "--setting", "long", "--out", str(tmp_path / "se_long.json")])
    assert set(result["methods"]) == set(se.LONG_METHODS)  # synthetic runs have no checkpoints: no matched rate yet
    chosen = se.SWEEP_LRS[1]
    assert all(entry["lr"] == chosen for entry in result["methods"].values())
    assert {m: v.get("lr_from") for m, v in result["sweep"].items() if m != "grpo"} == dict.fromkeys(
        se.LONG_METHODS[1:], "grpo")
    runs_dir = Path(result["meta"]["runs_dir"])
    swept = sorted(path.name for path in (runs_dir.parent / "default" / "sweep").iterdir())
    assert swept == sorted(f"grpo_lr{lr:g}" for lr in se.SWEEP_LRS)
    record = json.loads((runs_dir / "main" / "rredcot_seed1" / se.RUN_RECORD).read_text())
    assert "trainer.max_actor_ckpt_to_keep=null" in record["overrides"]
    assert result["meta"]["setting_parameters"]["preset"] == "long" and "norm_matched_rule" in result["meta"]


def test_norm_matched_runs_appear_once_the_first_seeds_runs_have_update_norms(tmp_path):
    se = sample_efficiency
    ledger = se.Ledger(tmp_path / "ledger", tmp_path / "runs")
    setting_dir = tmp_path / "runs" / "long"
    lrs = {method: {"lr": 3e-5} for method in se.LONG_METHODS}

    def specs():
        return se.main_specs("long", se.LONG_METHODS, lrs, [1, 2], 100, 50, 10, ("data.max_response_length=512",),
                             setting_dir, ledger)

    first = specs()
    assert list(first) == list(se.LONG_METHODS)
    for method, norm in (("grpo", 0.02), ("rredcot", 0.04), ("ibpo_resume", 0.0201)):
        spec = first[method][0]
        path = ledger.path(se.main_dir(setting_dir, method, 1))
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"update_norms": [{"step": 10, "adam_update_norm": norm}]}
        path.write_text(json.dumps({"spec": ledger.portable(spec), "summary": summary}))
    second = specs()
    assert list(second) == [*se.LONG_METHODS, "rredcot_norm_matched"]
    matched = second["rredcot_norm_matched"]
    assert [spec.seed for spec in matched] == [1, 2] and all(spec.method == "rredcot" for spec in matched)
    assert all(spec.lr == 1.5e-5 for spec in matched) and lrs["rredcot_norm_matched"]["update_norm_ratio"] == 0.5
    # IBPO's steps match GRPO's at GRPO's rate (to two digits): its runs there are the matched ones, none repeat them.
    assert lrs["ibpo_resume"]["norm_matched"]["lr"] == 3e-5 and "ibpo_resume_norm_matched" not in lrs
    assert lrs["rredcot"]["norm_matched"]["lr"] == 1.5e-5
    folder = se.main_dir(setting_dir, "rredcot_norm_matched", 2)
    assert f"trainer.default_local_dir={folder / 'checkpoints'}" in matched[1].overrides
    # The default and hard settings keep one checkpoint and have no matched runs.
    default = se.main_specs("default", ("grpo", "rredcot"), lrs, [1], 100, 50, 10, (), tmp_path / "d", ledger)
    assert list(default) == ["grpo", "rredcot"]
    assert "trainer.max_actor_ckpt_to_keep=1" in default["rredcot"][0].overrides


def test_items_prototype_smoke_trains_both_stages_and_scores_each_model(tmp_path):
    """items_prototype --smoke: stage 1 trains the items artefact on its own task, stage 2 the stage-1 model on
    three-digit items; each stage's checkpoints carry the exit accuracy by items left, and value_quality scores each
    stage's own model on its own task (three-digit answers in stage 2). A second run reuses the stages' models."""
    out = tmp_path / "ip.json"
    result = items_prototype.main(["--smoke", "--out", str(out)])
    trained_on, harder = result["stages"]["trained_on"], result["stages"]["three_digit_items"]
    assert "item_digits" not in trained_on["task"] and harder["task"]["item_digits"] == 3
    assert harder["source"].endswith("trained_on/model")
    for stage in (trained_on, harder):
        assert {row["step"] for row in stage["checkpoints"]} == {2, 4}
        assert {f"exit_{left}_left" for left in range(1, 8)} <= set(stage["checkpoints"][0])
        assert set(stage["value_quality"]["states"]) >= {"exit_raw", "exit_selfnorm"}
    assert all(len(str(int(trace["text"].split("boxed{")[1].split("}")[0]))) == 21
               for trace in harder["per_trace"] if trace["outcome"] == 1.0)
    assert all(len(t["mc"]) == len(t["segment_ends"]) for t in harder["per_trace"])
    written = (tmp_path / "items_prototype_cache" / "trained_on" / "record.json").stat().st_mtime_ns
    items_prototype.main(["--smoke", "--out", str(out)])
    assert (tmp_path / "items_prototype_cache" / "trained_on" / "record.json").stat().st_mtime_ns == written


def test_results_md_quotes_the_committed_items_prototype():
    """RESULTS.md's items_prototype bullet (and docs/choices.md's items3 section) quote the committed JSON: the exit
    accuracy by items left as the first stage trains on, each stage's kept accuracy, and the exit probe against
    Monte-Carlo values on the three-digit model's own traces."""
    result = json.loads((RESULTS / "items_prototype.json").read_text())
    flat = " ".join((RESULTS.parent / "RESULTS.md").read_text(encoding="utf-8").split())
    choices = " ".join((RESULTS.parents[1] / "docs" / "choices.md").read_text(encoding="utf-8").split())
    trained_on, harder = result["stages"]["trained_on"], result["stages"]["three_digit_items"]
    by_step = {row["step"]: row for row in trained_on["checkpoints"]}

    def exits(step):
        return " / ".join(f"{by_step[step][f'exit_{left}_left']:.2f}" for left in (1, 2, 4, 7))

    kept = by_step[trained_on["kept_step"]]
    last = max(by_step)
    assert f"{exits(kept['step'])} at step {kept['step']}, {exits(last)} at step {last}" in flat
    within = trained_on["value_quality"]["states"]["exit_selfnorm"]["within_spearman"]
    kept_text = f"sampled {kept['sampled']:.2f} at the kept step {kept['step']}"
    assert f"{kept_text}; its exit probe within a trace {within:.2f}" in flat
    final = {row["step"]: row for row in harder["checkpoints"]}[harder["kept_step"]]
    assert f"step {final['step']}: sampled {final['sampled']:.2f}, greedy {final['greedy']:.2f}" in flat
    values = harder["value_quality"]
    states, segments = values["states"]["exit_selfnorm"], values["segments"]
    assert (f"within a trace at {states['within_spearman']:.2f} against Monte-Carlo values (pooled "
            f"{states['spearman']:.2f})") in flat
    localised = (f"{segments['exit_selfnorm']['localisation']:.0%} of {segments['exit_selfnorm']['localisation_n']} "
                 f"wrong traces (Monte-Carlo values' own {segments['mc']['localisation']:.0%}, chance "
                 f"{values['localisation_chance']:.0%})")
    assert localised in flat
    assert f"sampled {final['sampled']:.1%}, greedy {final['greedy']:.1%}" in choices
    assert (f"within a trace at {states['within_spearman']:.2f} against Monte-Carlo values (pooled over states "
            f"{states['spearman']:.2f})") in choices
    sweep = json.loads((RESULTS / "grpo_sweep_items3.json").read_text())["by_rate"]
    best = sweep["1e-05"]
    assert f"at the best rate, 1e-5, greedy {best['greedy_rise']:+.2f} and sampled {best['sampled_rise']:+.2f}" in flat
    assert f"at 3e-5 both fall ({sweep['3e-05']['greedy_rise']:.2f}, {sweep['3e-05']['sampled_rise']:.2f})" in \
        flat.replace("\u2212", "-")
    assert f"collapses (greedy {sweep['0.0001']['greedy_rise']:.2f}; 3e-4 was not run)" in flat.replace("\u2212", "-")
    assert not sweep["0.0003"]["seeds"] and max(sweep, key=lambda rate: sweep[rate]["auc"] or 0) == "1e-05"
    # the one-line answer at the top of RESULTS.md
    assert (f"(within-trace {states['within_spearman']:.2f}, localisation "
            f"{segments['exit_selfnorm']['localisation']:.0%})") in flat
    assert f"(best rate: greedy {best['greedy_rise']:+.2f}, sampled {best['sampled_rise']:+.2f})" in flat
