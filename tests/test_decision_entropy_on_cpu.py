"""``benchmarks/decision_entropy.py``: per-token entropy and gradient mass against autograd on the warm start, the
per-trace counts by hand, and the committed JSON recomputing from its own traces and the committed screen."""

import json

import numpy as np
import pytest
import torch

from benchmarks import decision_entropy
from benchmarks.common import RESULTS_DIR, build_task
from rredcot_verl.tasks import load_model_dir
from rredcot_verl.tasks.arithmetic import ArithmeticProblem
from rredcot_verl.tasks.model import chat_prompt_ids


def test_participation_ratio_counts_equal_parts():
    assert decision_entropy.participation_ratio(np.array([1.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert decision_entropy.participation_ratio(np.array([0.5, 0.5, 0.0, 0.0])) == pytest.approx(2.0)
    assert decision_entropy.participation_ratio(np.array([3.0, 1.0])) == pytest.approx(16 / 10)
    assert decision_entropy.participation_ratio(np.zeros(4)) == 0.0


def test_trace_row_counts_uncertain_tokens_and_the_segments_holding_them():
    entropy = np.array([0.1, 0.6, 0.2, 0.2, 0.2, 0.9, 0.7])
    mass = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    row = decision_entropy.trace_row(entropy, mass, [2, 5, 7], outcome=0.0)
    # segments [0, 2) [2, 5) [5, 7): the first and the last hold uncertain tokens (0.6; 0.9 and 0.7), the middle none
    assert (row["uncertain_tokens"], row["uncertain_segments"], row["segments"]) == (3, 2, 3)
    assert row["gradient_tokens"] == pytest.approx(3.0)
    assert row["gradient_segments"] == pytest.approx(9 / 5)  # segment masses 1, 0, 2
    assert row["entropy_mean"] == pytest.approx(entropy.mean(), abs=5e-5)  # kept to 4 decimals
    assert row["error_entropy_max"] is None and row["error_chosen_min"] is None  # no error located

    chosen = np.array([0.9, 0.4, 0.95, 0.8, 0.99, 0.3, 0.6])
    wrong = decision_entropy.trace_row(entropy, mass, [2, 5, 7], 0.0, chosen, range(2, 5))
    assert (wrong["error_entropy_max"], wrong["error_chosen_min"]) == (0.2, 0.8)  # tokens 2-4 only
    right = decision_entropy.trace_row(entropy, mass, [2, 5, 7], 1.0, chosen, range(2, 5))
    assert right["error_entropy_max"] is None  # a correct trace has no error, whatever is passed


def test_error_tokens_are_the_first_wrong_steps_tokens_or_the_token_in_place_of_a_missing_one(tmp_path):
    tokenizer = load_model_dir(str(build_task(tmp_path / "build") / "model"))[1]
    problem = ArithmeticProblem((12, 7, 3), ("+", "-"))

    def located(text):
        ids = tokenizer.encode(text)
        span = decision_entropy.error_tokens(problem, ids, tokenizer.decode(ids, skip_special_tokens=True), tokenizer)
        return None if span is None else tokenizer.decode(ids[span.start: span.stop])

    assert located("<think>\n12+7=19\n19-3=17\n</think>\n\\boxed{17}") == "19-3=17"
    assert located("<think>\n12+7=18\n18-3=15\n</think>\n\\boxed{15}") == "12+7=18"
    assert located("<think>\n12+7=19\n</think>\n\\boxed{19}") == "</think>"  # step 2 missing: ended instead
    assert located("<think>\n12+7=19\n19-3=16\n</think>\n\\boxed{16}") is None


def test_token_statistics_are_the_entropy_and_the_squared_logit_gradient_of_log_pi(tmp_path):
    """On the committed warm start: the entropy of the next-token distribution at each response position, and the
    squared norm of d log pi(o_t) / d logits taken by autograd."""
    build = build_task(tmp_path / "build")
    model, tokenizer = load_model_dir(str(build / "model"))
    model.eval()
    prompt = torch.tensor(chat_prompt_ids(tokenizer, "Compute 12+7-3. Answer in \\boxed{}."))
    response = torch.tensor(tokenizer.encode("<think>\n12+7=19\n19-3=16\n</think>\n\\boxed{16}"))
    entropy, mass, chosen = decision_entropy.token_statistics(model, prompt, response)
    assert entropy.shape == mass.shape == chosen.shape == (response.numel(),)
    logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1: -1].detach()
    for t in (0, response.numel() // 2, response.numel() - 1):
        row = logits[t].clone().requires_grad_(True)
        log_pi = row.log_softmax(-1)
        (grad,) = torch.autograd.grad(log_pi[response[t]], row)
        assert mass[t] == pytest.approx(float(grad.pow(2).sum()), abs=1e-5)
        assert entropy[t] == pytest.approx(float(-(log_pi.exp() * log_pi).sum().detach()), abs=1e-5)
        assert chosen[t] == pytest.approx(float(log_pi[response[t]].detach().exp()), abs=1e-6)


def test_the_committed_json_recomputes_from_its_traces_and_the_screen():
    committed = json.loads(decision_entropy.RESULTS_PATH.read_text())
    screen = json.loads(decision_entropy.SCREEN_PATH.read_text())
    assert list(committed["settings"]) == list(decision_entropy.SETTINGS)
    for name, entry in committed["settings"].items():
        assert entry["summary"] == decision_entropy.summarise(entry["per_trace"]), name
        assert entry["summary"]["traces"] == committed["config"]["prompts"] * committed["config"]["samples_per_prompt"]
        assert entry["screen"] == decision_entropy.screen_row(screen, name), name  # stale if the screen moves
        for row in entry["per_trace"]:
            assert row["uncertain_segments"] <= min(row["uncertain_tokens"], row["segments"])
            assert 0 < row["gradient_segments"] <= row["segments"]
            if row["outcome"] == 1:
                assert row["error_entropy_max"] is None and row["error_chosen_min"] is None
            if row["error_chosen_min"] is not None:
                assert 0 <= row["error_chosen_min"] <= 1 and row["error_entropy_max"] >= 0  # 4 decimals: a rare token is 0
        # arithmetic verifiers find the error of nearly every wrong trace (a wrong boxed answer after right steps
        # is the only miss)
        errors = entry["summary"]["errors"]
        assert 0.9 * errors["wrong_traces"] <= errors["located"] <= errors["wrong_traces"], name
    assert committed["across_settings"] == decision_entropy.correlations(committed["settings"])
    results_md = (RESULTS_DIR.parent / "RESULTS.md").read_text(encoding="utf-8")
    assert decision_entropy.markdown_table(committed) in results_md  # RESULTS.md quotes the tables verbatim
    assert decision_entropy.error_table(committed) in results_md
    means = [entry["summary"]["uncertain_tokens"]["mean"] for entry in committed["settings"].values()]
    quoted = f"{min(means):.1f}-{max(means):.1f} tokens of entropy ≥ {decision_entropy.UNCERTAIN_NATS} nats"
    for text in (results_md, (RESULTS_DIR.parent.parent / "README.md").read_text(encoding="utf-8")):
        assert quoted in text  # the README's screen bullet and RESULTS.md's answer-now row


@pytest.mark.parametrize("temperature", decision_entropy.TEMPERATURES_REPORTED)
def test_the_committed_tempered_runs_recompute_and_results_md_quotes_them(temperature):
    """Sampled and scored at a higher temperature: the same settings and traces a setting, no screen columns (the
    screen sampled at the rollouts' temperature), summaries from their own traces, and RESULTS.md's table verbatim."""
    committed = json.loads(decision_entropy.RESULTS_PATH.read_text())
    tempered = json.loads(decision_entropy.tempered_path(temperature).read_text())
    assert tempered["config"]["temperature"] == temperature
    assert list(tempered["settings"]) == list(committed["settings"])
    for name, entry in tempered["settings"].items():
        assert "screen" not in entry
        assert entry["summary"] == decision_entropy.summarise(entry["per_trace"]), name
        assert entry["summary"]["traces"] == committed["settings"][name]["summary"]["traces"]
    assert tempered["across_settings"]["settings"] == []
    table = decision_entropy.temperature_table(
        [committed, *(json.loads(decision_entropy.tempered_path(t).read_text())
                      for t in decision_entropy.TEMPERATURES_REPORTED)])
    assert table in (RESULTS_DIR.parent / "RESULTS.md").read_text(encoding="utf-8")


def test_smoke_run_writes_the_table(tmp_path):
    result = decision_entropy.main(["--smoke", "--settings", "default", "early", "--out", str(tmp_path / "d.json")])
    written = json.loads((tmp_path / "d.json").read_text())
    assert list(written["settings"]) == ["default", "early"]
    for entry in written["settings"].values():
        assert entry["summary"]["traces"] + entry["empty_responses"] == 4 * 2
        assert entry["summary"]["length"]["mean"] > 0
    assert result["out"] == str(tmp_path / "d.json")
    hot = decision_entropy.main(["--smoke", "--settings", "early", "--temperature", "1.5",
                                 "--out", str(tmp_path / "hot.json")])
    assert hot["config"]["temperature"] == 1.5 and "screen" not in hot["settings"]["early"]
