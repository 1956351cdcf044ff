"""The light half of the benchmarks' library: the one JSON writer, the one table printer and the one CPU timer.

Standard library, torch and transformers only: ``value_pass.py gpu`` runs on a GPU image that has nothing else.
``benchmarks.common`` re-exports all of it.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


def machine_meta() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "python": platform.python_version()}


def cpu_seconds(fn) -> tuple[float, object]:
    """The process CPU seconds of one call of ``fn`` (not wall time: the machine is shared), and its result."""
    started = time.process_time()
    result = fn()
    return time.process_time() - started, result


def relative_to_repository(value):
    """``value`` with every absolute path inside the repository written relative to it (recursively through dicts
    and lists): a committed result must not carry the paths of the machine that ran it."""
    if isinstance(value, dict):
        return {key: relative_to_repository(item) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_to_repository(item) for item in value]
    if isinstance(value, str) and value.startswith("/"):
        path = Path(value)
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else value
    return value


def write_result(result: dict, out: Path, say: bool = True) -> dict:
    """Write a benchmark's JSON to ``out`` (folders made, written whole or not at all; paths inside the repository
    made relative to it), say where (unless not ``say``), and return the result with its path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(relative_to_repository(result), indent=2, default=float) + "\n")
    partial.replace(out)
    if say:
        print(f"wrote {out}")
    return {**result, "out": str(out)}


def out_path(args, results_path: Path) -> Path:
    """``--out``, else a temp file named as ``results_path`` with --smoke, else ``results_path``."""
    if args.out is not None:
        return args.out
    return Path(tempfile.mkdtemp()) / results_path.name if args.smoke else results_path


def fmt(value, width: int = 8, digits: int = 2) -> str:
    """A number right-aligned, or '-' for None."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_table(rows: list[dict], columns, title: str | None = None) -> None:
    """``rows`` under ``columns``: the keys to show (the headers), or {key: format spec, e.g. ".1e"}; without a spec
    a float shows with 3 decimals, anything else as text; a missing or None cell as '-', a list as its items. Each
    column as wide as its widest cell, the first left-aligned."""
    specs = columns if isinstance(columns, dict) else dict.fromkeys(columns, "")

    def cell(value, spec: str) -> str:
        if value is None:
            return "-"
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(cell(item, spec) for item in value) + "]"
        if spec:
            return format(value, spec)
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    cells = [[cell(row.get(key), spec) for key, spec in specs.items()] for row in rows]
    widths = [max([len(key), *(len(line[i]) for line in cells)]) for i, key in enumerate(specs)]
    if title:
        print(title)
    for line in [list(specs), *cells]:
        print("  ".join(text.ljust(width) if i == 0 else text.rjust(width)
                        for i, (text, width) in enumerate(zip(line, widths))))
