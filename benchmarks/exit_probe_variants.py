"""Is the exit probe's miss on condition (1) its normalisation? Its values on the screen's own batches, per
variant, against the Monte-Carlo values the screen committed for the same states.

The screen (``benchmarks/gradient_screen.py``) judges condition (1) with the recipes' exit probe, self-normalised: the
probability of the group's correct answers after a forced exit divided by the mass of every answer the group gave.
On ``items`` those values saturate near 1 once the right answer leads while Monte-Carlo values still climb (RESULTS.md,
"The screen"). This recomputes the exit probe's values on each screen run's 16 batches (its cached pool and policy,
``outputs/gradient_screen/<run>/``) under every ``probe.normalization`` and scores them with the screen's own
``value_conditions`` against the Monte-Carlo rows of that run's JSON (``results/gradient_screen_runs/<run>.json``,
``traces.value_agreement``). The self-normalised row recomputes the screen's; ``raw`` is the package's other
normalisation. A third variant is a diagnostic, not a package setting: ``self_normalized_slip_neighbours`` adds to
the self-normalising answer set every one-digit slip (±1) of the group's correct answers, the errors a trace has not
made yet, so that a state with items left cannot be valued near 1 just because it already differs from every wrong
answer the group wrote. No generation: the value pass only, about five minutes a run on two cores.

    python -m benchmarks.exit_probe_variants                 # every committed screen run whose cache is here
    python -m benchmarks.exit_probe_variants --runs items     # one run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from benchmarks import common, gradient_quality, gradient_screen
from rredcot_verl.core import planning

VARIANTS = ("self_normalized", "raw", "self_normalized_slip_neighbours")
RESULTS_PATH = common.RESULTS_DIR / "exit_probe_variants.json"
CACHE_DIR = common.ROOT / "outputs" / "gradient_screen"


def slips(answer: str) -> list[str]:
    """``answer`` with one digit one up or one down (no new leading zero): the slips a sampled line makes."""
    return [answer[:i] + str(int(digit) + step) + answer[i + 1:] for i, digit in enumerate(answer) if digit.isdigit()
            for step in (-1, 1) if 0 <= int(digit) + step <= 9 and not (i == 0 and int(digit) + step == 0)]


@contextlib.contextmanager
def slip_neighbours_in_banks():
    """Within it, every group's self-normalising answer set also holds the slips of its correct answers (the
    diagnostic variant; the planner builds the banks on this process before any worker starts)."""
    group_banks = planning._group_banks

    def with_slips(*args, **kwargs):
        banks = group_banks(*args, **kwargs)
        for bank in banks.values():
            bank.all_answers += [slip for answer in bank.correct_answers for slip in slips(answer)
                                 if slip not in bank.all_answers]
        return banks

    planning._group_banks = with_slips
    try:
        yield
    finally:
        planning._group_banks = group_banks


def variant_traces(run: dict, cache, variant: str) -> dict:
    """The run's ``traces.value_agreement`` with the exit-probe rows recomputed under ``variant`` on the same batches
    (traces whose segment count differs from the Monte-Carlo row's are left out, as the screen does)."""
    settings = run["settings"]
    pool = torch.load(cache / "pool.pt", weights_only=False)
    gstar = torch.load(cache / "gstar.pt", weights_only=False)
    if pool["fingerprint"]["setting"] != settings["setting"]:
        raise SystemExit(f"{cache}: a pool of {pool['fingerprint']['setting']}, not {settings['setting']}")
    policy = pool["fingerprint"].get("policy")  # the screen's policy folder, else the setting's warm start
    model_dir = cache / f"policy_{policy}" if policy else cache / "build" / "model"
    model, tokenizer = gradient_quality.load_model_dir(str(model_dir))
    model.eval()  # no dropout
    _, exit_probe = common.method_settings(gradient_quality.VALUE_AGREEMENT[0])
    normalization = "raw" if variant == "raw" else "self_normalized"
    exit_probe = dataclasses.replace(exit_probe, probe=dataclasses.replace(exit_probe.probe,
                                                                           normalization=normalization))
    monte_carlo = run["traces"]["value_agreement"]
    seed, size = settings["seeds"]["prompt_draw"], settings["headline_prompts"]
    rows = {}
    for b in range(settings["batches_per_size"]):
        items = common.draw_batch(seed, settings["pool_prompts"], settings["pool_rollouts_per_prompt"], size,
                                  settings["group_size"], b)
        batch = gradient_quality.make_batch(pool, gstar, items)
        with slip_neighbours_in_banks() if variant == "self_normalized_slip_neighbours" else contextlib.nullcontext():
            values, _ = gradient_quality.batch_segment_values(batch, pool, exit_probe, model, tokenizer, {})
        for i, (p, r) in enumerate(items):
            trace = monte_carlo.get(f"{p},{r}")
            segments = int((values["segment_ends"][i] >= 0).sum())
            if trace is None or segments != len(trace["monte_carlo"]) - 1:
                continue
            rows[f"{p},{r}"] = {**trace, "exit_probe": values["raw_values"][i, :segments].double().tolist()
                                + [trace["outcome"]]}
    return {"value_agreement": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_PATH, help="JSON path (runs already in it are kept)")
    parser.add_argument("--runs", nargs="*", default=None,
                        help="screen runs (results/gradient_screen_runs/<run>.json); default: every one whose cache "
                             "is under outputs/gradient_screen/")
    args = parser.parse_args(argv)
    runs = args.runs or sorted(path.stem for path in gradient_screen.RUNS_DIR.glob("*.json")
                               if (CACHE_DIR / path.stem / "pool.pt").exists())
    result = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    for name in runs:
        run = json.loads((gradient_screen.RUNS_DIR / f"{name}.json").read_text())
        result["runs"][name] = {
            variant: gradient_screen.value_conditions(variant_traces(run, CACHE_DIR / name, variant))
            for variant in VARIANTS}
    result["meta"] = {"command": "python -m benchmarks.exit_probe_variants [--runs RUN ...]",
                      "monte_carlo": "the screen run's committed rows (K = 16, 4 decimals)",
                      "exit_probe": f"{gradient_quality.VALUE_AGREEMENT[0]} (common.METHODS) with "
                                    "probe.normalization set; slip neighbours: see the module docstring",
                      **common.machine_meta()}
    common.write_result(result, args.out)
    print(markdown_table(result))
    return result


def markdown_table(result: dict) -> str:
    lines = ["| screen run | exit-probe values | within-trace Spearman (states) | localisation: exit probe / MC / "
             "chance | states at >= 0.99 |", "|---|---|---|---|---|"]
    for name, variants in sorted(result["runs"].items()):
        for variant, c in variants.items():
            lines.append(f"| `{name}` | {variant} | {c['within_trace_spearman']:.2f} "
                         f"({c['state_spearman']:.2f}) | {c['localisation']:.0%} / {c['localisation_monte_carlo']:.0%} "
                         f"/ {c['localisation_chance']:.0%} | {c['saturated_share']:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
