"""Where is each setting's warm start uncertain? Token entropy and policy-gradient mass along its sampled traces,
beside the screen's ceiling: a diagnostic for condition (2), "traces hold many uncertain decisions".

Segment credit can only beat GRPO's uniform credit when one trace holds several uncertain decisions in different
segments: with the policy sure of every token but one, the policy gradient of a trace lives on that token, and any
per-segment weighting scales the same direction. The screen counts segments (median ≥ 8), which says nothing about
where the policy is uncertain. This script samples each setting's committed warm start (temperature 1, the rollouts'
distribution, 64 prompts of the setting's own validation data × 4) and measures per trace:

- ``entropy_mean``: mean token entropy (nats) over the response;
- ``uncertain_tokens``: tokens whose entropy is at least ``UNCERTAIN_NATS``;
- ``uncertain_segments``: of the recipe's segments (hybrid, at most 8: the screen's), those holding an uncertain token;
- ``gradient_tokens``: the participation ratio (Σ m_t)² / Σ m_t² of the logit-gradient mass
  m_t = ||onehot(o_t) − π_t||² = 1 − 2 π_t(o_t) + Σ_j π_t(j)², the squared norm of ∇_logits log π(o_t): how many
  tokens the trace's policy gradient effectively rests on (1: one token carries it all);
- ``gradient_segments``: the same ratio over the segments' summed mass: how many segments it rests on;
- on a wrong trace whose steps the task's verifier can check, where the error sits: ``error_entropy_max``, the
  largest entropy over the first wrong step's tokens (for a missing step, the token written in its place), and
  ``error_chosen_min``, the smallest probability the policy gave a token it wrote there. A slip (an uncertain token
  there) and a confident error (every token there written with π ≥ ``CONFIDENT_P``) ask different things of a
  testbed: more slips multiply the chance of a wrong trace; confident errors are rarely sampled right at all.

The table puts each setting's means (the JSON also has medians, the share of traces with at least 3 and 4 uncertain
segments, and the uncertain tokens at a looser and a stricter threshold, ``OTHER_NATS``) beside its warm-start screen
row (``results/gradient_screen.json``: the best Monte-Carlo ceiling form's cosine to g* minus GRPO's, and GRPO's own
cosine) and the Spearman correlation across the settings. Six settings are six points: the correlation describes, it
does not test.

    python -m benchmarks.decision_entropy           # about 2 min on one core: results/decision_entropy.json
    python -m benchmarks.decision_entropy --smoke   # 20 s: two settings, 4 prompts × 2, temp output
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import common
from rredcot_verl.core.segmentation import segment_response
from rredcot_verl.report import tokens_in_span
from rredcot_verl.tasks import load_model_dir
from rredcot_verl.tasks.base import arithmetic_wrong_span

RESULTS_PATH = common.RESULTS_DIR / "decision_entropy.json"
SCREEN_PATH = common.RESULTS_DIR / "gradient_screen.json"
CACHE_DIR = common.ROOT / "outputs" / "decision_entropy"
SETTINGS = ("default", "hard", "long", "early", "items", "items3")  # the screen's, at their warm starts
UNCERTAIN_NATS = 0.5  # a token the policy could well have written otherwise (a fair coin is 0.69 nats)
TEMPERATURES_REPORTED = (1.2, 1.4)  # RESULTS.md's temperature table, beside the rollouts' 1.0
OTHER_NATS = (0.1, 1.0)  # the same count at a looser and a stricter threshold: is the picture the threshold's?
CONFIDENT_P = 0.9  # an error the policy wrote with every token at least this likely: confident, not a slip
PER_TRACE = ("length", "entropy_mean", "uncertain_tokens", "uncertain_segments", "segments", "gradient_tokens",
             "gradient_segments")


def participation_ratio(mass: np.ndarray) -> float:
    """(Σ m)² / Σ m²: the number of equal parts that would give the same concentration; 0 for no mass."""
    squares = float(np.sum(mass**2))
    return float(np.sum(mass) ** 2 / squares) if squares > 0 else 0.0


@torch.no_grad()
def token_statistics(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor,
                     temperature: float = common.ROLLOUT_TEMPERATURE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per response token: the entropy (nats), the logit-gradient mass ||onehot(o_t) − π_t||² and the probability
    π_t(o_t) of the token written, under the policy sampled at ``temperature`` (verl scores log-probs at the rollout's
    temperature)."""
    tokens = torch.cat([prompt_ids, response_ids]).long()[None]
    logits = model(input_ids=tokens).logits[0, prompt_ids.numel() - 1: -1].float() / temperature
    log_probs = logits.log_softmax(-1)
    probs = log_probs.exp()
    entropy = -(probs * log_probs).sum(-1)
    chosen = probs.gather(-1, response_ids.long()[:, None]).squeeze(-1)
    mass = 1 - 2 * chosen + (probs**2).sum(-1)
    return (entropy.numpy().astype(float), mass.clamp(min=0).numpy().astype(float),
            chosen.numpy().astype(float))


def error_tokens(problem, response_ids: list[int], text: str, tokenizer) -> range | None:
    """Token indices of the first wrong step of a response (for a missing step, the token written where it would
    start); None when the verifier finds every step right. The embedded tokenizer's pieces spell the text."""
    found = arithmetic_wrong_span(problem, text)
    if found is None:
        return None
    pieces = [tokenizer.decode([token], skip_special_tokens=True) for token in response_ids]
    if "".join(pieces) != text:
        raise ValueError("the tokenizer's pieces do not spell the decoded response: token spans cannot be mapped")
    span = tokens_in_span(pieces, *found[1])
    return span if span else range(min(span.start, len(pieces) - 1), min(span.start, len(pieces) - 1) + 1)


def trace_row(entropy: np.ndarray, mass: np.ndarray, ends: list[int], outcome: float,
              chosen: np.ndarray | None = None, errors: range | None = None) -> dict:
    """One trace's statistics (``PER_TRACE``) from its per-token entropy and gradient mass and its segment ends, and
    on a wrong trace with ``errors`` (its first wrong step's tokens) the entropy and chosen probability there."""
    starts = [0, *ends[:-1]]
    located = outcome < 1 and errors is not None and chosen is not None
    uncertain = entropy >= UNCERTAIN_NATS
    # 4 decimals: the committed JSON keeps every trace, and its summaries are recomputed from these rounded rows
    return {"outcome": outcome, "length": int(entropy.size),
            "entropy_mean": round(float(entropy.mean()), 4) if entropy.size else 0.0,
            "uncertain_tokens": int(uncertain.sum()),
            "uncertain_tokens_at": {str(nats): int((entropy >= nats).sum()) for nats in OTHER_NATS},
            "uncertain_segments": int(sum(bool(uncertain[a:b].any()) for a, b in zip(starts, ends))),
            "segments": len(ends), "gradient_tokens": round(participation_ratio(mass), 4),
            "gradient_segments": round(participation_ratio(np.array([mass[a:b].sum() for a, b in zip(starts, ends)])),
                                       4),
            "error_entropy_max": round(float(entropy[errors.start: errors.stop].max()), 4) if located else None,
            "error_chosen_min": round(float(chosen[errors.start: errors.stop].min()), 4) if located else None}


def summarise(rows: list[dict]) -> dict:
    """Medians and means of ``PER_TRACE`` over a setting's traces, the share of traces with at least 3 and 4 uncertain
    segments, the mean count of tokens at ``OTHER_NATS``, the sampled accuracy, and where the located errors sit."""
    located = [r for r in rows if r["error_entropy_max"] is not None]
    summary = {"traces": len(rows), "accuracy": float(np.mean([r["outcome"] for r in rows])),
               "errors": {"wrong_traces": sum(r["outcome"] < 1 for r in rows), "located": len(located),
                          "uncertain_share": float(np.mean([r["error_entropy_max"] >= UNCERTAIN_NATS
                                                            for r in located])) if located else None,
                          "chosen_min_median": float(np.median([r["error_chosen_min"] for r in located]))
                          if located else None,
                          "confident_share": float(np.mean([r["error_chosen_min"] >= CONFIDENT_P for r in located]))
                          if located else None},
               "uncertain_segments_at_least": {str(n): float(np.mean([r["uncertain_segments"] >= n for r in rows]))
                                               for n in (3, 4)},
               "uncertain_tokens_at": {str(nats): float(np.mean([r["uncertain_tokens_at"][str(nats)] for r in rows]))
                                       for nats in OTHER_NATS}}
    for key in PER_TRACE:
        values = np.array([r[key] for r in rows], dtype=float)
        summary[key] = {"median": float(np.median(values)), "mean": float(values.mean())}
    return summary


def screen_row(screen: dict, setting: str) -> dict:
    """The setting's warm-start screen figures: best ceiling form, its cosine minus GRPO's (with interval), GRPO's."""
    row = screen["settings"][setting]
    best = row["methods"][row["best_ceiling"]]
    return {"best_ceiling": row["best_ceiling"], "ceiling_minus_grpo": best["minus_grpo"],
            "ceiling_minus_grpo_ci95": best["minus_grpo_ci95"], "grpo_cosine": row["methods"]["grpo"]["cosine"]}


def correlations(settings: dict) -> dict:
    """Spearman, across the settings, of each per-trace mean (medians of counts tie) against the ceiling's lead over
    GRPO and GRPO's cosine."""
    names = [name for name, entry in settings.items() if "screen" in entry]
    out = {}
    for key in PER_TRACE:
        means = [settings[name]["summary"][key]["mean"] for name in names]
        out[key] = {target: common.spearman(means, [settings[name]["screen"][target] for name in names])
                    for target in ("ceiling_minus_grpo", "grpo_cosine")}
    return {"settings": names, "spearman": out}


def measure(setting: str, num_prompts: int, samples: int, seed: int, temperature: float) -> dict:
    limits = common.SETTINGS[setting]
    build = common.build_task(CACHE_DIR / setting / "build", limits.preset)
    data = common.write_setting_data(CACHE_DIR / setting / "data", limits, 256, common.MAIN_DATA_SEED)
    model, tokenizer = load_model_dir(str(build / "model"))
    model.eval()
    _, settings = common.method_settings("rredcot")  # the screen's segmentation (the recipe's)
    vocab = settings.boundary_vocab(tokenizer)
    started = time.perf_counter()
    problems = common.load_problems(Path(data["val_files"]), num_prompts)
    traces = common.sample_traces(model, tokenizer, problems, samples, seed, limits.max_response_length, temperature)
    rows = []
    for trace in traces:
        if trace.response_ids.numel() == 0:
            continue
        entropy, mass, chosen = token_statistics(model, trace.prompt_ids, trace.response_ids, temperature)
        ends = segment_response(trace.response_ids, torch.from_numpy(entropy).float(), vocab, settings.segmentation)
        errors = (None if trace.outcome >= 1
                  else error_tokens(trace.problem, trace.response_ids.tolist(), trace.text, tokenizer))
        rows.append(trace_row(entropy, mass, ends, trace.outcome, chosen, errors))
    return {"seconds": time.perf_counter() - started, "summary": summarise(rows), "per_trace": rows,
            "empty_responses": len(traces) - len(rows)}


def markdown_table(result: dict) -> str:
    """RESULTS.md's table: per setting, the per-trace means and the screen's warm-start row, then the correlations."""
    lines = ["| setting, warm start | sampled accuracy | tokens a trace | entropy, nats a token | uncertain tokens: "
             f"≥ {UNCERTAIN_NATS} nats ({' / '.join(f'≥ {nats}' for nats in OTHER_NATS)}) | "
             "segments | uncertain segments (traces with ≥ 3 / ≥ 4) | gradient rests on: tokens / segments | "
             "best ceiling − GRPO | GRPO cosine |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in result["settings"].items():
        summary, screen = entry["summary"], entry["screen"]
        mean = {key: summary[key]["mean"] for key in PER_TRACE}
        share = summary["uncertain_segments_at_least"]
        low, high = screen["ceiling_minus_grpo_ci95"]
        lines.append(f"| `{name}` | {summary['accuracy']:.2f} | {mean['length']:.0f} | {mean['entropy_mean']:.3f} | "
                     f"{mean['uncertain_tokens']:.2f} ("
                     + " / ".join(f"{summary['uncertain_tokens_at'][str(nats)]:.1f}" for nats in OTHER_NATS)
                     + f") | {mean['segments']:.1f} | {mean['uncertain_segments']:.2f} "
                     f"({share['3']:.0%} / {share['4']:.0%}) | {mean['gradient_tokens']:.2f} / "
                     f"{mean['gradient_segments']:.2f} | {screen['ceiling_minus_grpo']:+.3f} [{low:+.3f}, {high:+.3f}]"
                     f" | {screen['grpo_cosine']:.3f} |")
    spearman = result["across_settings"]["spearman"]
    lines.append("")
    lines.append("Spearman across the six settings (means; six points describe, they do not test): ceiling − GRPO "
                 "against " + ", ".join(f"{key.replace('_', ' ')} {spearman[key]['ceiling_minus_grpo']:+.2f}"
                                         for key in PER_TRACE) + ".")
    return "\n".join(lines)


def error_table(result: dict) -> str:
    """RESULTS.md's table of where each setting's errors sit (the located first wrong steps of its wrong traces)."""
    lines = [f"| setting, warm start | sampled accuracy | wrong traces (first wrong step located) | that step holds a "
             f"token ≥ {UNCERTAIN_NATS} nats | smallest π of a token written there, median | confident errors "
             f"(every token there π ≥ {CONFIDENT_P}) |", "|---|---|---|---|---|---|"]
    for name, entry in result["settings"].items():
        summary = entry["summary"]
        errors = summary["errors"]
        lines.append(f"| `{name}` | {summary['accuracy']:.2f} | {errors['wrong_traces']} ({errors['located']}) | "
                     f"{errors['uncertain_share']:.0%} | {errors['chosen_min_median']:.2f} | "
                     f"{errors['confident_share']:.0%} |")
    return "\n".join(lines)


def print_table(result: dict) -> None:
    rows = [{"setting": name, "acc": entry["summary"]["accuracy"],
             **{key: entry["summary"][key]["mean"] for key in PER_TRACE},
             **entry.get("screen", {})} for name, entry in result["settings"].items()]
    common.print_table(rows, ["setting", "acc", "length", "entropy_mean", "uncertain_tokens", "uncertain_segments",
                              "segments", "gradient_tokens", "gradient_segments", "ceiling_minus_grpo", "grpo_cosine"],
                       f"per-trace means at the warm start (uncertain: entropy >= {UNCERTAIN_NATS} nats)")
    common.print_table([{"setting": name, **entry["summary"]["errors"]} for name, entry in result["settings"].items()],
                       ["setting", "wrong_traces", "located", "uncertain_share", "chosen_min_median",
                        "confident_share"], "where the errors sit: the first wrong step of each wrong trace")
    for key, targets in (result["across_settings"]["spearman"].items() if result["across_settings"]["settings"]
                         else ()):
        print(f"  Spearman across settings, {key}: " + ", ".join(
            f"{target} {common.fmt(value, 0)}" for target, value in targets.items()))


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATH, "two settings, 4 prompts x 2; temp output", build=False)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=sorted(common.SETTINGS))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="traces a prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=common.ROLLOUT_TEMPERATURE,
                        help="sampling temperature, also the one the policy is scored at (default the rollouts'); "
                             "another leaves out the screen's columns, which were sampled at the rollouts' "
                             "temperature, and writes results/decision_entropy_t<T>.json")
    args = parser.parse_args(argv)
    tempered = args.temperature != common.ROLLOUT_TEMPERATURE
    if args.smoke:
        args.settings, args.prompts, args.samples = args.settings[:2], 4, 2
    torch.set_num_threads(1)
    screen = json.loads(SCREEN_PATH.read_text())
    settings = {}
    for setting in args.settings:
        settings[setting] = measure(setting, args.prompts, args.samples, args.seed, args.temperature)
        if setting in screen["settings"] and not tempered:
            settings[setting]["screen"] = screen_row(screen, setting)
        print(f"{setting}: {settings[setting]['summary']['traces']} traces in {settings[setting]['seconds']:.0f}s",
              flush=True)
    result = {"settings": settings, "across_settings": correlations(settings),
              "config": {"prompts": args.prompts, "samples_per_prompt": args.samples, "seed": args.seed,
                         "uncertain_nats": UNCERTAIN_NATS, "temperature": args.temperature,
                         "data": "each setting's validation parquet (common.write_setting_data, data seed "
                                 f"{common.MAIN_DATA_SEED}), its first prompts", "screen": str(SCREEN_PATH),
                         "segmentation": "rredcot.yaml's (hybrid, at most 8 segments), as the screen cuts"},
              "meta": {**common.machine_meta(), "script": "benchmarks/decision_entropy.py",
                       "command": "python -m benchmarks.decision_entropy"
                                  + (f" --temperature {args.temperature}" if tempered else "")}}
    print_table(result)
    return common.write_result(result, common.out_path(args, tempered_path(args.temperature) if tempered
                                                       else RESULTS_PATH))


def tempered_path(temperature: float) -> Path:
    return common.RESULTS_DIR / f"decision_entropy_t{temperature:g}.json"


def temperature_table(results: list[dict]) -> str:
    """RESULTS.md's table of the same counts at several sampling temperatures (one result a temperature)."""
    lines = ["| setting | temperature | sampled accuracy | uncertain tokens | uncertain segments (traces with ≥ 4) | "
             "gradient rests on: segments |", "|---|---|---|---|---|---|"]
    for name in results[0]["settings"]:
        for result in results:
            summary = result["settings"][name]["summary"]
            lines.append(f"| `{name}` | {result['config']['temperature']:g} | {summary['accuracy']:.2f} | "
                         f"{summary['uncertain_tokens']['mean']:.2f} | {summary['uncertain_segments']['mean']:.2f} "
                         f"({summary['uncertain_segments_at_least']['4']:.0%}) | "
                         f"{summary['gradient_segments']['mean']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
