"""The main job on the embedded default: train GRPO, RREDCoT and IBPO for the same steps, then compare.

    python recipes/tiny_cpu/demo.py [--out outputs/demo] [--steps 30] [--methods grpo rredcot ibpo]

Each run goes through ``recipes/tiny_cpu/run.sh`` (real verl trainer, vLLM in Ray workers), its full log in
``<out>/<method>/train.log``; a progress bar follows the steps from verl's ``metrics.jsonl``. At the end:
``<out>/curves.png``, ``<out>/comparison.json``, the credit report of the RREDCoT run (and of IBPO) and a table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rredcot_verl.runs import load_metrics, validation_key, write_comparison  # noqa: E402


def train(method: str, out: Path, steps: int, timeout_s: int) -> list[dict]:
    run_dir = out / method
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OUT": str(run_dir), "RREDCOT_STEPS": str(steps), "RUN_TIMEOUT": str(timeout_s)}
    metrics_path = run_dir / "metrics.jsonl"
    with open(run_dir / "train.log", "w") as log:
        process = subprocess.Popen(
            ["bash", str(ROOT / "recipes/tiny_cpu/run.sh"), method], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        # A terminal gets a live bar; a log (CI, `ray job logs`) gets one line per finished step instead of a bar
        # redrawn every poll.
        interactive = sys.stderr.isatty()
        bar = tqdm(total=steps, desc=f"{method:>10}", unit="step", disable=not interactive)
        reported = 0
        while process.poll() is None:
            time.sleep(2)
            rows = load_metrics(metrics_path)
            done = min(max((row["step"] for row in rows), default=0), steps)
            bar.update(max(0, done - bar.n))
            if not interactive:
                for row in rows:
                    if reported < row["step"] <= done:
                        print(_step_line(method, row, steps), flush=True)
                reported = max(reported, done)
        bar.update(max(0, steps - bar.n) if process.returncode == 0 else 0)
        bar.close()
    if process.returncode != 0:
        tail = (run_dir / "train.log").read_text().splitlines()[-30:]
        sys.exit(f"{method} failed (exit {process.returncode}); last lines of {run_dir / 'train.log'}:\n" + "\n".join(tail))
    return load_metrics(metrics_path)


def _step_line(method: str, row: dict, steps: int) -> str:
    """One log line for a finished step: train reward and, when the step validated, validation accuracy."""
    parts = [f"{method} step {row['step']}/{steps}"]
    if "critic/score/mean" in row:
        parts.append(f"reward {row['critic/score/mean']:.3f}")
    key = validation_key([row])
    if key:
        parts.append(f"val {row[key]:.3f}")
    return "  ".join(parts)


def credit_report(run_dir: Path, out: Path, suffix: str) -> None:
    snapshots = run_dir / "snapshots"
    if not snapshots.is_dir():
        return
    target = out / f"credit_report{suffix}"
    result = subprocess.run(
        [sys.executable, "-m", "rredcot_verl.report", "--snapshot", str(snapshots), "--out", str(target)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(f"credit report of {run_dir} failed:\n{result.stderr[-3000:]}")
    for name in ("credit_report.jsonl", "credit_report.html"):
        (target / name).replace(out / name.replace("credit_report", f"credit_report{suffix}"))
    target.rmdir()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "outputs/demo"))
    parser.add_argument("--steps", type=int, default=int(os.environ.get("RREDCOT_STEPS", 30)))
    parser.add_argument("--methods", nargs="+", default=["grpo", "rredcot", "ibpo"])
    parser.add_argument("--timeout-s", type=int, default=1200, help="hard limit per training run")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = {method: train(method, out, args.steps, args.timeout_s) for method in args.methods}
    table = write_comparison(runs, out)
    for method in args.methods:
        credit_report(out / method, out, "" if method == "rredcot" else f"_{method}")
    print("\n" + table)
    print(f"\ncurves: {out / 'curves.png'}\ncredit report: {out / 'credit_report.html'}")
    print(f"training wall time: {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
