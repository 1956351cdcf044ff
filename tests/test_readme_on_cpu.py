"""The README against its sources: every gain and step cost it quotes is recomputed from the JSON in
``benchmarks/results/`` it names, at the rounding it shows; the launch commands of its choice table compose (verl's
config, the strict ``algorithm.rredcot`` reader) into the configurations the study measured; its plain ``k=v`` launch
composes; ``submit.sh`` takes a recipe from anywhere; ``python_requires`` and the README agree; its links resolve.

When this fails after a new measurement, change the README (or the recipe), not the test: the README may only quote
what the results hold."""

import ast
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from benchmarks.common import METHODS
from benchmarks.verdict import equal_compute_rollouts
from rredcot_verl.core.settings import DataOffer, settings_from_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
RESULTS = ROOT / "benchmarks" / "results"
HARD = json.loads((RESULTS / "sample_efficiency_hard.json").read_text())
DEFAULT = json.loads((RESULTS / "sample_efficiency.json").read_text())
RESTATED = json.loads((RESULTS / "restated_hard.json").read_text())  # benchmarks.verdict on the hard study
AGAINST_GRPO = RESTATED["comparisons"]["grpo"]
RESTATED_LONG = json.loads((RESULTS / "restated_long.json").read_text())
GRADIENT_LONG = json.loads((RESULTS / "gradient_quality_long.json").read_text())
TIMING_REFERENCE = json.loads((RESULTS / "sample_efficiency_timing_reference" / "grpo_hard_seed1.json").read_text())
VALUE_GATE = json.loads((RESULTS / "value_gate.json").read_text())
ROW_LABELS = "ABCDEF"


def plain(text: str) -> str:
    """The README's typography as ASCII: U+2212 minus, U+00D7 times, U+2013 range dash, U+2014 "none"."""
    return text.replace("\u2212", "-").replace("\u00d7", "x").replace("\u2013", "-").replace("\u2014", "-")


# The README as one line of ASCII: a phrase may wrap anywhere.
FLAT = " ".join(plain(README).split())


def signed(x: float, decimals: int = 3) -> str:
    return f"{x:+.{decimals}f}"


def interval(difference: float, ci: list[float]) -> str:
    return f"{signed(difference)} [{signed(ci[0])}, {signed(ci[1])}]"


def decimals_of(shown: str) -> int:
    return len(shown.split(".")[1]) if "." in shown else 0


def span(values, decimals: int) -> str:
    return f"{min(values):.{decimals}f}-{max(values):.{decimals}f}"


def paired_interval(comparison: dict) -> str:
    return interval(comparison["paired"]["difference"], comparison["paired"]["ci95"])


def time_shift(comparison: dict) -> str:
    """The paired time shift as the README shows it: factor [95% interval], one decimal, an upper end past 100 as
    ">100"."""
    shift = comparison["time_shift"]["paired"]
    low, high = shift["ci95"]
    return f"{shift['estimate']:.1f}x [{low:.1f}, {'>100' if high > 100 else f'{high:.1f}'}]"


# ------------------------------------------------------------------------------------------------ the choice table


def choice_rows() -> dict[str, list[str]]:
    rows = {}
    for line in README.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells[0]) == 1 and cells[0] in ROW_LABELS and len(cells) == 7:
            rows[cells[0]] = [plain(cell) for cell in cells]
    assert sorted(rows) == list(ROW_LABELS), f"the choice table's rows A-F not found: {sorted(rows)}"
    return rows


def row_runs() -> dict[str, str]:
    """Row label -> the arm of restated_hard.json (a run of sample_efficiency_hard.json) the README names for it."""
    sentence = re.search(r"Rows\s+are\s+the\s+arms\s(.+?)\sof\s+`benchmarks/results/restated_hard\.json`", README, re.S)
    assert sentence, "the README no longer names the runs behind its choice table"
    runs = re.findall(r"`([a-z_]+)`", sentence.group(1).replace("methods.", ""))
    assert len(runs) == len(ROW_LABELS)
    return dict(zip(ROW_LABELS, runs))


def cost_base(footnote: str) -> float:
    """GRPO's median step of the sitting a cost's footnote names."""
    return {"¹": HARD["methods"]["grpo"]["median_step_s"], "²": TIMING_REFERENCE["summary"]["median_step_s"]}[footnote]


def row_cost(label: str) -> tuple[float, int]:
    """(ratio, decimals shown) of a row's step cost, recomputed from its JSON and sitting."""
    cost = choice_rows()[label][6]
    value, footnote = re.fullmatch(r"([0-9.]+)x ([¹²])", cost).groups()
    return HARD["methods"][row_runs()[label]]["median_step_s"] / cost_base(footnote), decimals_of(value)


@pytest.mark.parametrize("label", list(ROW_LABELS))
def test_choice_table_gains_steps_and_costs_are_the_json(label):
    cells, run = choice_rows()[label], row_runs()[label]
    comparison = AGAINST_GRPO[run]
    assert cells[2] == paired_interval(comparison), (label, run)
    assert cells[3] == f"{comparison['paired']['p_holm']:.2f}", (label, run)
    assert cells[4] == time_shift(comparison), (label, run)
    ratio, decimals = row_cost(label)
    assert cells[6].split("x")[0] == f"{ratio:.{decimals}f}", (label, run)
    # Equal step time: GRPO's rollouts at the row's step cost, and the row minus that GRPO run if one was made.
    rollouts = round(equal_compute_rollouts(ratio, 1.0, 4))
    control = RESTATED["comparisons"].get(f"grpo_n{rollouts}")
    if control and run in control:
        assert cells[5] == f"{signed(control[run]['paired']['difference'])}, n = {rollouts}", (label, run)
        low, high = control[run]["paired"]["ci95"]
        assert low < 0 < high  # the footnote: "every interval of a row minus `grpo_n6` includes 0"
    else:
        assert cells[5] == f"- (n = {rollouts})", (label, run)


# The projected GPU step of each row's setting (gpu_projection.json's estimators), three significant digits.
PROJECTED_FOR_ROW = {"A": "rredcot_reference", "B": "ibpo", "C": "rredcot_repair_bank", "D": "rredcot_ibpo",
                     "E": "rredcot_exit_probe", "F": "segment_mc"}


def test_the_projected_gpu_step_of_each_row_is_the_json():
    projection = json.loads((RESULTS / "gpu_projection.json").read_text())["estimators"]
    shown = {label: f"{label} {projection[name]['over_grpo']:.3g}x" for label, name in PROJECTED_FOR_ROW.items()}
    low, high = projection["rredcot_repair_bank"]["over_grpo_range"]
    shown["C"] += f" ({low:.1f}-{high:.0f}x over its assumptions)"
    assert "(H200s, the paper recipe, not run; RESULTS.md §2), rows below: " + ", ".join(shown.values()) in FLAT


def test_choice_table_footnotes_are_the_json():
    text = FLAT
    rate = {label: HARD["methods"][run]["lr"] / HARD["methods"]["grpo"]["lr"] for label, run in row_runs().items()}
    assert all(rate[label] == 1 for label in "ABCDE")
    assert f"A-E at GRPO's learning rate, F at a {1 / rate['F']:.0f}x smaller one" in text
    assert f"GRPO {HARD['methods']['grpo']['median_step_s']:.2f} s a step" in text
    assert f"({TIMING_REFERENCE['summary']['median_step_s']:.2f} s a step" in text
    assert f"adjusted over the {len(AGAINST_GRPO)} arms compared with GRPO" in text
    resolved = [label for label in ROW_LABELS if AGAINST_GRPO[row_runs()[label]]["paired"]["ci95"][0] > 0]
    assert f"before the correction only {' and '.join(resolved)} have intervals above 0, after it none does" in text
    holm = {arm: c["paired"]["p_holm"] for arm, c in AGAINST_GRPO.items()}
    assert min(holm, key=holm.get) == "grpo_n10" and min(holm.values()) >= 0.05
    assert f"GRPO's own with 10 rollouts, {holm['grpo_n10']:.2f})" in text
    steps = {arm: RESTATED["arms"][arm]["median_step_s"]["1"] for arm in ("grpo_n6", "grpo_n10")}
    assert f"`grpo_n6` {steps['grpo_n6']:.2f} s and `grpo_n10` {steps['grpo_n10']:.2f} s a step" in text
    assert sorted(arm for arm in RESTATED["arms"] if arm.startswith("grpo_n")) == ["grpo_n10", "grpo_n6"]
    assert "only `grpo_n6` and `grpo_n10` were run (-: no run), and every interval of a row minus `grpo_n6` includes 0" \
        in text
    gate = HARD["methods"][row_runs()["E"]]["diagnostics"]
    first, last = gate["first"]["rredcot/value_gate_open"], gate["last"]["rredcot/value_gate_open"]
    assert f"`value_gate_open` {first:.2f} over the first 10 steps, {last:.0f} over the last 10" in text
    assert "the default `resume` matches them in gradient quality (§4) and was trained on the long setting only" in text


def test_status_lines_are_the_json():
    text = FLAT
    # The first line: the registered verdict (results/verdict.json), its seeds, its primary comparison and value quality.
    verdict = json.loads((RESULTS / "verdict.json").read_text())
    primary = verdict["comparisons"][verdict["registration"]["reference"]]["rredcot_exit_probe"]
    seeds = {tuple(arm["seeds"]) for arm in verdict["arms"].values()}
    assert len(seeds) == 1
    (run,) = seeds
    registered = verdict["registration"]["seeds"]
    complete = run == tuple(registered)
    assert (f"registered study ({'' if complete else 'incomplete: '}seeds {run[0]}-{run[-1]} of {len(registered)})"
            in text.replace("**", ""))
    assert primary["decision"] == ("incomplete" if not complete else primary["decision"])
    # The reading (RESULTS.md "The verdict"): inconclusive, because no arm trained. Every arm's greedy accuracy ends
    # below the warm start's and no arm's sampled reward rose; the registered decisions resolve nothing.
    signal = verdict["training_signal"]["arms"]
    (start,) = {arm["validation_start"]["mean"] for arm in signal.values()}
    ends = [arm["validation_end"]["mean"] for arm in signal.values()]
    assert all(arm["validation_end"]["max"] < start and arm["reward_change"]["ci95"][0] <= 0 for arm in signal.values())
    assert {c["decision"] for block in verdict["comparisons"].values() for c in block.values()} == {"not resolved"}
    assert (f"of {len(registered)}): inconclusive, the setting failed. No arm trained, GRPO included (greedy accuracy "
            f"{start:.3f} → {span(ends, 3)})") in text.replace("**", "")
    assert "level with GRPO at equal compute" not in text
    early = json.loads((RESULTS / "value_quality_early.json").read_text())["states"]["exit_selfnorm"]
    assert (f"exit-probe values: Spearman {early['spearman']:.2f} on states, {early['within_spearman']:.2f} within a "
            "trace") in text
    leaders = [AGAINST_GRPO[row_runs()[label]]["paired"] for label in "ABC"]
    bare = text.replace("**", "").replace("≥", ">=")
    assert (f"lead GRPO by {signed(min(t['difference'] for t in leaders))} to "
            f"{signed(max(t['difference'] for t in leaders))} AUC; none is resolved after a Holm correction over the "
            f"{len(AGAINST_GRPO)} arms (p >= {min(t['p_holm'] for t in leaders):.2f})") in bare
    # At equal compute: B-D's step cost buys GRPO 6 rollouts a prompt, and they lead that run by this much.
    assert {round(equal_compute_rollouts(row_cost(label)[0], 1.0, 4)) for label in "BCD"} == {6}
    equal = [RESTATED["comparisons"]["grpo_n6"][row_runs()[label]]["paired"]["difference"] for label in "BCD"]
    assert f"(GRPO with 6 rollouts a prompt, not 4: {signed(min(equal))} to {signed(max(equal))})" in bare
    n10 = AGAINST_GRPO["grpo_n10"]
    assert f"GRPO with 2.5x its rollouts gains most: {paired_interval(n10)}" in text
    assert all(n10["paired"]["difference"] > AGAINST_GRPO[run]["paired"]["difference"] for run in row_runs().values())
    costs = [row_cost(label)[0] for label in "ABCDE"]
    assert f"{span(costs, 2)}x measured, `segment_mc` {row_cost('F')[0]:.2f}x" in text
    lengths = {name: (data["methods"]["grpo"]["diagnostics"]["first"]["response_length/mean"]
                      + data["methods"]["grpo"]["diagnostics"]["last"]["response_length/mean"]) / 2
               for name, data in (("default", DEFAULT), ("hard", HARD))}
    assert f"({lengths['default']:.0f} on the default task, {lengths['hard']:.0f} on the hard one)" in text


def test_gpu_value_pass_line_is_the_json():
    gpu = json.loads((RESULTS / "gpu_check.json").read_text())
    row = gpu["cost"]["rows"][0]
    assert gpu["meta"]["device"] == "NVIDIA H200" and gpu["cost"]["response_tokens"] == 25_000
    assert gpu["cost"]["layers"] == 36 and gpu["meta"]["model"] == "qwen3-4b"
    shown = (f"{row['value_pass_seconds']:.2f} s, {row['time_over_forward']:.2f}x a bare forward, "
             f"{row['value_pass_pass_peak_mib'] / 1024:.1f} GiB above the weights")
    assert shown in FLAT


def test_what_else_to_change_is_the_json():
    text = FLAT
    norm = {label: HARD["methods"][row_runs()[label]]["grad_norm_mean"] / HARD["methods"]["grpo"]["grad_norm_mean"]
            for label in "ABCD"}
    assert f"rows A, C and D train with gradients {span([norm[k] for k in 'ACD'], 1)}x GRPO's norm " \
           f"(B: {norm['B']:.1f}x)" in text
    lr = {m: DEFAULT["methods"][m]["lr"] for m in ("grpo", "rredcot")}
    assert f"a {lr['grpo'] / lr['rredcot']:.0f}x smaller one" in text
    paper = {name: OmegaConf.load(ROOT / "recipes" / "paper" / f"qwen3_4b_numina_{name}.yaml").actor_rollout_ref.actor
             .optim.lr for name in ("grpo", "rredcot")}
    assert paper["rredcot"] == paper["grpo"] / 2 and "the paper recipe halves it" in text


def test_length_line_brackets_the_gradient_gain_by_grpos_measured_points():
    """The long setting's gradient gain as GRPO's measured cosines bracket it (more than 128 rollouts, fewer than
    256), not as its fitted curve extrapolates it; IBPO's training gain with its correction."""
    fit = GRADIENT_LONG["grpo_fit"]
    measured = dict(zip(fit["sizes_rollouts"], fit["measured_cosines"]))
    fitted = dict(zip(fit["sizes_rollouts"], fit["fitted_cosines"]))
    methods = GRADIENT_LONG["methods"]
    cosines = [methods[m]["batches"]["128"]["cosine_mean"] for m in ("ibpo_resume", "rredcot")]
    assert all(measured[128] < cosine < measured[256] for cosine in cosines)
    assert (f"worth 1-2x GRPO's rollouts as measured (cosine {cosines[0]:.3f} / {cosines[1]:.3f}; GRPO's "
            f"{measured[128]:.3f} at 128 rollouts, {measured[256]:.3f} at 256; the "
            f"{methods['ibpo_resume']['ess_over_grpo_at_32']:.1f}x / {methods['rredcot']['ess_over_grpo_at_32']:.1f}x "
            f"once quoted extrapolated a fit putting GRPO's 256 point at {fitted[256]:.3f})") in FLAT
    ibpo = RESTATED_LONG["comparisons"]["grpo"]["ibpo_resume"]
    assert f"IBPO gains {paired_interval(ibpo)}, Holm p {ibpo['paired']['p_holm']:.2f}" in FLAT


def test_watch_list_ranges_are_the_json():
    text = FLAT
    training = VALUE_GATE["training"]
    reference = [v for run in ("rredcot", "rredcot_ground_truth", "rredcot_group")
                 for v in training[f"hard/{run}_seed3"]["concordance"].values()]
    exit_probe = list(training["hard/rredcot_exit_probe_seed3"]["concordance"].values())
    assert f"| {span(reference, 2)} (reference values) | the exit probe's {span(exit_probe, 2)} was at chance" in text

    def diagnostic(runs, key):
        return [HARD["methods"][run]["diagnostics"][part][key] for run in runs for part in ("first", "last")]

    bank = diagnostic(("rredcot_ibpo", "rredcot_repairs_degenerate"), "rredcot/bank_groups_empty")
    assert f"| {span(bank, 1)} of 8 groups (repair bank) |" in text
    repairs = diagnostic(("ibpo", "rredcot_ibpo", "rredcot_repairs_degenerate"), "ibpo/repair_success_rate")
    assert f"| `ibpo/repair_success_rate` | {span(repairs, 2)} |" in text


def test_watch_list_names_metrics_the_estimators_log():
    """Every metric the README tells a user to watch is one a launched run logged (the support matrix's runs)."""
    logged = set()
    for path in (RESULTS / "support_matrix_runs").glob("*.json"):
        logged |= set(re.findall(r'"([a-z_]+/[a-z_/]+)"', path.read_text()))
    watched = re.findall(r"^\| `([a-z_]+/[a-z_/*]+)` \|", README, re.M)
    assert len(watched) >= 5
    for name in watched:
        prefix = name.rstrip("*")
        assert any(key == name or (name.endswith("*") and key.startswith(prefix)) for key in logged), name


# ------------------------------------------------------------------------------- the launch commands and recipes


def _compose(config_dir: Path, name: str | None, overrides=()):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def method_keys(config) -> dict:
    """The keys that define what an estimator computes (task-specific ones such as segmentation, the tiny model's
    revision template or a cost cap left out), from the composed config through the strict reader."""
    estimator = str(config.algorithm.adv_estimator)
    s = settings_from_config(config.algorithm)
    keys = {"adv_estimator": estimator}
    if estimator in ("rredcot", "rredcot_ibpo", "segment_mc"):
        r = s.redistribution
        keys.update(value_mapping=r.value_mapping, degenerate_groups=r.degenerate_groups, mix=r.mix,
                    min_value_concordance=r.min_value_concordance)
    if estimator in ("rredcot", "rredcot_ibpo"):
        keys.update(value_source=s.probe.value_source, candidates=s.candidates.source)
    if estimator == "ibpo" or s.candidates.uses_repairs and estimator != "segment_mc":
        i = s.ibpo
        keys.update(shaping_weight=i.shaping_weight, repair_bonus=i.repair_bonus, num_references=i.num_references,
                    use_mask=i.use_mask, aggregate=i.aggregate)
        if hasattr(i, "repair_operator"):  # how a repair is asked for, where the package offers a choice
            keys.update(repair_operator=i.repair_operator)
    if estimator == "rredcot_ibpo":
        keys.update(wrong_trace_credit=s.rredcot_ibpo.wrong_trace_credit)
    if estimator == "segment_mc":
        keys.update(num_continuations=s.segment_mc.num_continuations)
    return keys


@pytest.fixture
def recipe_env(monkeypatch):
    for name, value in {"DATA_DIR": "/data", "RREDCOT_BUILD": "/build", "RREDCOT_REWARD_FILE": "/reward.py"}.items():
        monkeypatch.setenv(name, value)


@functools.cache
def measured_keys(run: str) -> dict:
    """What the study ran for ``run``: its tiny recipe with the overrides the JSON records for it."""
    overrides = HARD["meta"]["method_overrides"][run]
    return method_keys(_compose(ROOT / "recipes" / "tiny_cpu", METHODS[run].recipe, overrides))


def bash_block(marker: str) -> str:
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"no single bash block holding {marker!r}"
    return found[0]


def choice_overrides() -> dict[str, list[str]]:
    """Row label -> the README's plain ``k=v`` overrides for that row (one command line each, ``# A`` at its end)."""
    block = bash_block("ibpo.repair_operator=rewrite")
    assert "$" not in block, "a row's overrides hold a shell variable: not pasteable as they stand"
    rows: dict[str, list[str]] = {}
    for line in block.replace("\\\n", " ").splitlines():
        words, _, label = line.partition("#")
        assert re.fullmatch(r" [A-F]", label) and label.strip() not in rows, line
        rows[label.strip()] = shlex.split(words)
        assert all(re.fullmatch(r"[\w.]+=\S+", word) for word in rows[label.strip()]), line
    return rows


PRIMARY = ROOT / "rredcot_verl" / "conf"


def parse_launch(argv: list[str]) -> tuple[Path, str | None, list[str]]:
    assert argv[:3] == ["python", "-m", "rredcot_verl.main"], argv
    rest, config_dir, name = argv[3:], PRIMARY, None
    if "--config-dir" in rest:
        config_dir = ROOT / rest[rest.index("--config-dir") + 1]
        name = rest[rest.index("--config-name") + 1]
        rest = [arg for arg in rest if not arg.startswith("--") and arg not in (str(config_dir.relative_to(ROOT)), name)]
    return config_dir, name, [arg for arg in rest if arg != "--check-only"]


@pytest.mark.parametrize("label", list("ABCDE"))
def test_choice_overrides_run_what_the_study_measured(label):
    """A row's overrides, on the package's primary config (what a plain ``k=v`` launch composes), set up the
    configuration the row's numbers come from, whatever the data: none of its keys is left to ``auto``."""
    launched, measured = readme_row_keys(label), measured_keys(row_runs()[label])
    differ = {key: (launched.get(key), measured.get(key)) for key in {*launched, *measured}
              if launched.get(key) != measured.get(key)}
    assert not differ, (f"README row {label}'s overrides run other settings than the study's {row_runs()[label]} "
                        f"(key: (overrides, study)): {differ}; add the study's keys, or say the row is not what was "
                        "measured")
    config = _compose(PRIMARY, "rredcot_trainer", choice_overrides()[label])
    with_solutions, without = (settings_from_config(config.algorithm, DataOffer(worked_solutions=offer))
                               for offer in (True, False))
    assert with_solutions == without, f"row {label} leaves a key to auto: it would depend on the data"


def test_plain_overrides_launch_composes_without_a_config_name(monkeypatch):
    """The README's ``k=v`` example: the package's primary config (verl's ppo_trainer + algorithm.rredcot)."""
    monkeypatch.setenv("DATA", "/data")
    argv = shlex.split(os.path.expandvars(bash_block("--check-only").replace("\\\n", " ")))
    config_dir, name, overrides = parse_launch(argv)
    assert name is None and "--check-only" in argv
    config = _compose(config_dir, "rredcot_trainer", overrides)
    assert config.algorithm.adv_estimator == "ibpo" and config.actor_rollout_ref.rollout.n >= 2
    assert settings_from_config(config.algorithm).task == "gsm8k"
    assert config.reward.custom_reward_function.path  # ibpo judges its repairs with the rule reward


def test_shipped_gpu_recipes_ran_what_was_measured_or_say_so(recipe_env):
    """A GPU recipe whose estimator settings match no configuration of the study says so in its first lines."""
    measured = [measured_keys(run) for run in HARD["meta"]["method_overrides"]]
    for path in sorted([*(ROOT / "recipes" / "paper").glob("*.yaml"), *(ROOT / "recipes" / "gpu_single").glob("*.yaml")]):
        keys = method_keys(_compose(path.parent, path.stem))
        head = "\n".join(path.read_text().splitlines()[:10])
        assert keys in measured or "NOT MEASURED HERE" in head, path.name


GPU_SINGLE = ROOT / "recipes" / "gpu_single"
ONE_GPU_RECIPE = GPU_SINGLE / "qwen3_0p6b_gsm8k.yaml"
COMPARE = GPU_SINGLE / "compare.sh"


def header(path: Path) -> str:
    """A recipe's or script's first comment block (its first lines, up to the first line of code)."""
    lines = path.read_text().splitlines()
    code = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    return "\n".join(lines[:code])


def reads_solutions(config) -> bool:
    """Whether a run's estimator reads the dataset's worked solutions (reference continuations of them)."""
    s = settings_from_config(config.algorithm)
    return (str(config.algorithm.adv_estimator) in ("rredcot", "rredcot_ibpo")
            and s.probe.value_source == "reference_continuation" and s.candidates.uses_dataset)


@functools.cache
def readme_row_keys(label: str) -> dict:
    """The estimator keys of the README's overrides for row ``label`` on the package's primary config."""
    return method_keys(_compose(PRIMARY, "rredcot_trainer", choice_overrides()[label]))


# Stands in for ``python`` in compare.sh: a training launch prints the metrics path it was given and its arguments
# and writes a short metrics.jsonl there (validation at steps 0 and 2, its accuracy fixed by the run's name); any other
# command runs the real interpreter (compare.sh's closing comparison).
FAKE_LAUNCH = """#!/bin/sh
if [ "$2" = "rredcot_verl.main" ]; then
  echo "run $VERL_FILE_LOGGER_PATH"
  for a in "$@"; do echo "arg $a"; done
  acc=$(printf %s "$VERL_FILE_LOGGER_PATH" | wc -c)
  for step in 0 1 2; do
    echo "{\\"step\\": $step, \\"data\\": {\\"val-core/openai/gsm8k/reward/mean@1\\": 0.$acc$step, \\"critic/score/mean\\": 0.$step, \\"timing_s/step\\": 1.5}}" >> "$VERL_FILE_LOGGER_PATH"
  done
  exit 0
fi
exec REAL_PYTHON "$@"
"""


def run_compare(tmp_path: Path):
    """compare.sh with the launches stood in by ``FAKE_LAUNCH``; returns the finished process."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(FAKE_LAUNCH.replace("REAL_PYTHON", sys.executable))
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "DATA_DIR": "/data", "OUT": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(COMPARE)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def compare_runs(tmp_path: Path) -> dict[str, list[str]]:
    """Run name -> overrides of each launch ``compare.sh`` makes."""
    runs: dict[str, list[str]] = {}
    for line in run_compare(tmp_path).stdout.splitlines():
        kind, _, value = line.partition(" ")
        if kind == "run":
            name = Path(value).parent.name
            runs[name] = []
        elif kind == "arg":
            runs[name].append(value)
    for name, argv in runs.items():
        assert argv[:4] == ["-m", "rredcot_verl.main", "--config-dir", str(GPU_SINGLE)], argv
        assert argv[4:6] == ["--config-name", ONE_GPU_RECIPE.stem], argv
        assert f"trainer.experiment_name={ONE_GPU_RECIPE.stem}_{name}" in argv, "its logs are not named for the run"
        runs[name] = argv[6:]
    return runs


def test_one_gpu_recipe_runs_the_readme_row_it_names(recipe_env):
    """The one-GPU recipe as written is the README's row its header names: the same estimator keys as that row's
    README command (which the study measured, test above) and the study's group size; the rest is GPU scale."""
    row = re.search(r"As written: the README's row ([A-F])\b", header(ONE_GPU_RECIPE))
    assert row, "the one-GPU recipe's header names no README row it runs"
    config = _compose(GPU_SINGLE, ONE_GPU_RECIPE.stem)
    assert method_keys(config) == readme_row_keys(row.group(1)) == measured_keys(row_runs()[row.group(1)])
    study = _compose(ROOT / "recipes" / "tiny_cpu", METHODS[row_runs()[row.group(1)]].recipe)
    assert config.actor_rollout_ref.rollout.n == study.actor_rollout_ref.rollout.n, "not the study's group size"
    assert "NOT MEASURED HERE" not in header(ONE_GPU_RECIPE)


def test_compare_runs_are_the_readme_rows_named_for_their_solutions(tmp_path, recipe_env):
    """``compare.sh`` trains GRPO and every README row whose command starts from the one-GPU recipe, each with
    that row's keys; its header lists each run with its row; a run's name says whether it reads the dataset's
    solutions; a run at a setting the study did not measure is named on a NOT MEASURED HERE line."""
    runs, text = compare_runs(tmp_path), header(COMPARE)
    rows = {label for label, cells in choice_rows().items() if re.search(r"\((solutions|answers)\)$", cells[1])}
    listed = dict(re.findall(r"^#\s+([a-z_]+)\s+(?:README row ([A-F])\b|the baseline)", text, re.M))
    assert set(listed) == set(runs), f"compare.sh's header lists {sorted(listed)}, it runs {sorted(runs)}"
    assert sorted(label for label in listed.values() if label) == sorted(rows), "not every one-GPU row is run once"
    measured = [measured_keys(run) for run in HARD["meta"]["method_overrides"]]
    for name, overrides in runs.items():
        config = _compose(GPU_SINGLE, ONE_GPU_RECIPE.stem, overrides)
        keys = method_keys(config)
        label = listed[name]
        expected = readme_row_keys(label) if label else measured_keys("grpo")
        differ = {key: (keys.get(key), expected.get(key)) for key in {*keys, *expected}
                  if keys.get(key) != expected.get(key)}
        assert not differ, f"compare.sh's {name} is not README row {label or 'GRPO'} (key: (run, README)): {differ}"
        suffix = "_with_solutions" if reads_solutions(config) else "_without_solutions"
        assert name == keys["adv_estimator"] + suffix, f"{name}: expected {keys['adv_estimator'] + suffix}"
        assert keys in measured or re.search(rf"NOT MEASURED HERE.*\b{name}\b", text), name


def test_compare_ends_with_the_demos_table_and_curves_of_its_runs(tmp_path):
    """After its launches, compare.sh prints the demo's comparison table of every run (in launch order, each run's
    final validation accuracy read from its metrics) and writes curves.png and comparison.json beside them."""
    result = run_compare(tmp_path)
    out = tmp_path / "out"
    names = [Path(line.split(" ", 1)[1]).parent.name for line in result.stdout.splitlines() if line.startswith("run ")]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in table[1:]] == ["run", *names][1:] and len(names) == 5
    summaries = json.loads((out / "comparison.json").read_text())
    assert list(summaries) == names
    for name in names:
        accuracy = float(f"0.{len(str(out / name / 'metrics.jsonl'))}2")
        assert summaries[name]["val_final"] == pytest.approx(accuracy) and summaries[name]["steps"] == 2
        assert f"| {name} | 2 |" in result.stdout
    assert (out / "curves.png").stat().st_size > 10_000


def test_paper_recipes_say_how_to_switch_to_the_measured_value_source(recipe_env):
    """A paper recipe left at the exit probe names the README's measured row that replaces it, with the exact
    overrides, and those overrides on the recipe compose into that row's keys."""
    recommended = readme_row_keys("A")["value_source"]
    for path in sorted((ROOT / "recipes" / "paper").glob("*_rredcot.yaml")):
        config = _compose(path.parent, path.stem)
        if settings_from_config(config.algorithm).probe.value_source == recommended:
            continue
        text = header(path)
        assert "NOT MEASURED HERE" in text and "reproduces the paper's setting" in text, path.name
        row = re.findall(r"README's row ([A-F])\b", text)[-1]
        overrides = [word for line in text.splitlines() if re.fullmatch(r"#\s+(algorithm\.\S+=\S+\s*)+", line)
                     for word in line[1:].split()]
        assert overrides, f"{path.name} names no overrides to the measured value source"
        assert method_keys(_compose(path.parent, path.stem, overrides)) == readme_row_keys(row), path.name


def test_submit_takes_a_recipe_from_anywhere(tmp_path):
    """``recipes/paper/submit.sh`` with a recipe outside recipes/paper, a paper name, and plain overrides (``ray``
    stood in by a script that prints its arguments)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (fake / "ray").chmod(0o755)
    mine = tmp_path / "my_recipes"
    mine.mkdir()
    (mine / "exp.yaml").write_text((ROOT / "recipes" / "gpu_single" / "qwen3_0p6b_gsm8k.yaml").read_text())
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "RAY_ADDRESS": "http://head:8265"}

    def submitted(*args):
        result = subprocess.run(["bash", str(ROOT / "recipes" / "paper" / "submit.sh"), *args], env=env,
                                capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert result.returncode == 0, result.stderr
        argv = result.stdout.splitlines()
        return argv[argv.index("--") + 1:]

    base = ["python", "-m", "rredcot_verl.main"]
    assert submitted("my_recipes/exp.yaml", "a=1") == [*base, "--config-dir", str(mine), "--config-name", "exp", "a=1"]
    assert submitted("my_recipes/exp") == [*base, "--config-dir", str(mine), "--config-name", "exp"]
    assert submitted("qwen3_4b_numina_rredcot") == [
        *base, "--config-dir", str(ROOT / "recipes" / "paper"), "--config-name", "qwen3_4b_numina_rredcot"]
    assert submitted("algorithm.adv_estimator=ibpo", "x=1") == [*base, "algorithm.adv_estimator=ibpo", "x=1"]
    missing = subprocess.run(["bash", str(ROOT / "recipes" / "paper" / "submit.sh"), "nothere"], env=env,
                             capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "no recipe nothere" in missing.stderr


def test_submit_forwards_tracking_and_hub_variables_through_the_jobs_runtime_env(tmp_path):
    """The job's ``--runtime-env-json`` carries the tracker and hub variables set in the submitting shell (and the
    names in SUBMIT_ENV), not others; the job's driver joins the cluster it runs on."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ray").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (fake / "ray").chmod(0o755)
    shell = {"WANDB_API_KEY": "key-1", "WANDB_PROJECT": "proj", "WANDB_ENTITY": "team", "HF_TOKEN": "hf-2",
             "HF_HOME": "/shared/hf", "DATA_DIR": "/shared/data", "RREDCOT_SEED": "3", "MY_SETTING": "x",
             "UNRELATED_SECRET": "must-stay"}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HF_", "RREDCOT_"))}, **shell,
           "PATH": f"{fake}:{os.environ['PATH']}", "RAY_ADDRESS": "http://head:8265", "SUBMIT_ENV": "MY_SETTING"}
    result = subprocess.run(["bash", str(ROOT / "recipes" / "paper" / "submit.sh"), "qwen3_4b_numina_rredcot"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = result.stdout.splitlines()
    forwarded = json.loads(argv[argv.index("--runtime-env-json") + 1])["env_vars"]
    assert forwarded == {**{k: v for k, v in shell.items() if k != "UNRELATED_SECRET"}, "RAY_ADDRESS": "auto",
                         "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"}
    assert argv[argv.index("--address") + 1] == "http://head:8265"


# ------------------------------------------------------------------------------------------------ packaging, links


def test_python_versions_agree_with_setup_py():
    from packaging.specifiers import SpecifierSet

    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {k.arg: k.value for k in call.keywords}
    spec = SpecifierSet(ast.literal_eval(keywords["python_requires"]))
    low, high = re.search(r"Python 3\.(\d+)\u20133\.(\d+)", README).groups()
    allowed = [f"3.{minor}" for minor in range(int(low), int(high) + 1)]
    assert all(version in spec for version in allowed)
    assert f"3.{int(low) - 1}" not in spec and f"3.{int(high) + 1}" not in spec
    assert "3.11" in spec and "Python 3.11" in README  # the CPU stack's interpreter
    assert ast.literal_eval(keywords["license"]) == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()


def test_readme_is_a_front_page_with_the_two_set_up_commands_and_links_that_resolve():
    lines = README.splitlines()
    assert len(lines) <= 150
    table_rows = [line for line in lines if line.startswith("|")]
    assert max(len(line) for line in table_rows) <= 120
    block = bash_block("scripts/test.sh")
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == [
        "bash recipes/tiny_cpu/demo.sh", "bash scripts/test.sh"]
    for target, anchor in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#([^)]+))?\)", README):
        path = ROOT / target
        assert path.exists(), target
        if anchor:
            headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in headings, f"{target}#{anchor}"
    assert "arXiv 2605.16302" in README  # IBPO: the one paper whose id the repository records (core/ibpo)


def test_usage_examples_of_an_own_task_and_profile_load(tmp_path, monkeypatch):
    """docs/usage.md's worked ``module:attr`` task and probe-profile override, as a user would copy them."""
    import sys

    from rredcot_verl.tasks.base import check_dataset_rows, resolve_task

    usage = (ROOT / "docs" / "usage.md").read_text()
    code = re.search(r"```python\n(# my_tasks\.py.*?)```", usage, re.S).group(1)
    (tmp_path / "my_tasks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_tasks", raising=False)
    name = re.search(r"`algorithm\.rredcot\.task=(my_tasks:\w+)`", usage).group(1)
    task = resolve_task(name)
    assert task.extract_answer("so 5/2 = 2.5\n\\boxed{2.50}") == "2.50" and task.equivalent("2.50", "2.5")
    assert task.split_steps("5/2\n\n= 2.5\n") == ["5/2", "= 2.5"]
    rows = [{"prompt": [{"role": "user", "content": "What is 5/2? Put your final answer within \\boxed{}."}],
             "reward_model": {"ground_truth": "2.5"}, "extra_info": {"reference_solution": "5/2 = \\boxed{2.5}"}}]
    assert check_dataset_rows(name, rows) is None  # the launcher's dataset check accepts it
    profile_yaml = re.search(r"```yaml\n(algorithm:\n  rredcot:\n    probe:.*?)```", usage, re.S).group(1)
    settings = settings_from_config(OmegaConf.create(profile_yaml).algorithm)
    profile = settings.probe.profile_for()
    assert (profile.think_start, profile.think_end) == ("<reasoning>", "</reasoning>")
    assert profile.exit_text.endswith("\\boxed") and profile.answer_prefix == "{"
