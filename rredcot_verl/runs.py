"""Reading training runs back: verl's FileLogger ``metrics.jsonl``, per-run summaries and comparison curves.

Used by the demo (``recipes/tiny_cpu/demo.py``), every benchmark that reads a run (``load_metrics``) and, as a
command, by ``recipes/gpu_single/compare.sh``:

    python -m rredcot_verl.runs --out DIR RUN [RUN ...]   # reads DIR/RUN/metrics.jsonl; writes DIR/curves.png,
                                                          # DIR/comparison.json and prints the table

No verl/ray imports.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

VAL_PREFIX = "val-core/"
STEP_TIME = "timing_s/step"


def load_metrics(path: str | Path) -> list[dict]:
    """One dict per logged step: ``{"step": n, **metrics}``, in file order; missing file → []. A last line cut short
    (a run killed mid-write, or one still writing) is dropped; a broken line elsewhere raises."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                break
            raise
        rows.append({"step": int(record["step"]), **record["data"]})
    return rows


def step_seconds(rows: list[dict], phase: str = "step") -> list[float]:
    """``timing_s/<phase>`` of steps ≥ 2 (step 1 carries warm-up)."""
    key = f"timing_s/{phase}"
    return [row[key] for row in rows if row["step"] >= 2 and key in row]


def median_step_s(rows: list[dict]) -> float | None:
    """The one step-time statistic (this summary's and every benchmark's): the median ``timing_s/step`` of steps ≥ 2;
    None without any."""
    seconds = step_seconds(rows)
    return statistics.median(seconds) if seconds else None


def validation_key(rows: list[dict]) -> str | None:
    """The validation accuracy metric (``val-core/<data_source>/reward/mean@1``) of a run, if it logged one."""
    keys = sorted({k for row in rows for k in row if k.startswith(VAL_PREFIX) and k.endswith("/mean@1")})
    return keys[0] if keys else None


def curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(row["step"], float(row[key])) for row in rows if key in row and math.isfinite(float(row[key]))]


def summarize(rows: list[dict]) -> dict:
    """Initial / final / best validation accuracy, mean train reward of the last steps, wall time."""
    key = validation_key(rows)
    val = curve(rows, key) if key else []
    reward = curve(rows, "critic/score/mean")
    step_times = [t for _, t in curve(rows, STEP_TIME)]
    tail = [r for _, r in reward[-5:]]
    return {
        "steps": max((row["step"] for row in rows), default=0),
        "val_initial": val[0][1] if val else None,
        "val_final": val[-1][1] if val else None,
        "val_best": max(v for _, v in val) if val else None,
        "train_reward_last5": sum(tail) / len(tail) if tail else None,
        "train_time_s": sum(step_times),
        "median_step_s": median_step_s(rows),
    }


def plot_curves(runs: dict[str, list[dict]], path: str | Path) -> None:
    """Validation accuracy and train reward against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_val, ax_reward) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        key = validation_key(rows)
        if key:
            steps, values = zip(*curve(rows, key)) if curve(rows, key) else ((), ())
            ax_val.plot(steps, values, marker="o", label=name)
        reward = curve(rows, "critic/score/mean")
        if reward:
            steps, values = zip(*reward)
            ax_reward.plot(steps, values, label=name, alpha=0.8)
    ax_val.set(title="validation accuracy (greedy)", xlabel="step", ylabel="accuracy")
    ax_reward.set(title="train reward (sampled)", xlabel="step", ylabel="mean reward")
    for ax in (ax_val, ax_reward):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(summaries: dict[str, dict]) -> str:
    columns = ["steps", "val_initial", "val_final", "val_best", "train_reward_last5", "median_step_s", "train_time_s"]
    lines = ["| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, summary in summaries.items():
        cells = []
        for column in columns:
            value = summary.get(column)
            cells.append("—" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value)))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_comparison(runs: dict[str, list[dict]], out: str | Path) -> str:
    """``out/curves.png`` and ``out/comparison.json`` (each run's ``summarize``) for ``runs``; returns the table."""
    out = Path(out)
    plot_curves(runs, out / "curves.png")
    summaries = {name: summarize(rows) for name, rows in runs.items()}
    (out / "comparison.json").write_text(json.dumps(summaries, indent=2))
    return format_table(summaries)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare finished runs: curves.png, comparison.json and a table.")
    parser.add_argument("--out", required=True, help="folder holding RUN/metrics.jsonl for each run")
    parser.add_argument("runs", nargs="+", help="run folders under --out, in the table's order")
    args = parser.parse_args(argv)
    out = Path(args.out)
    runs = {name: load_metrics(out / name / "metrics.jsonl") for name in args.runs}
    empty = [name for name, rows in runs.items() if not rows]
    if empty:
        print(f"rredcot_verl.runs: no metrics in {', '.join(str(out / name / 'metrics.jsonl') for name in empty)}",
              file=sys.stderr)
        return 2
    print(write_comparison(runs, out))
    print(f"\ncurves: {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
