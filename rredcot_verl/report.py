"""Per-trace credit report: where did each trace's advantage land? (JSONL + one self-contained HTML heat map)

The trainer writes a snapshot (``write_snapshot``) every ``algorithm.rredcot.snapshot_freq`` steps when
``algorithm.rredcot.snapshot_dir`` is set, holding at most ``snapshot_max_traces`` traces (whole prompt groups)::

    python -m rredcot_verl.report --snapshot SNAPSHOT_DIR_OR_FILE --out OUT_DIR [--max-traces N]

A directory means its newest ``step_XXXXX.json``. The command writes ``OUT_DIR/credit_report.jsonl`` and
``OUT_DIR/credit_report.html`` (inline CSS, no scripts or external assets: token backgrounds show the advantage,
red < 0 < green, scaled by the page's largest |A|; segment ends carry V_k and R_k; IBPO-edited tokens are underlined;
the first wrong step of a trace, for tasks that check steps, is framed and flagged ⚠).

``credit_report.jsonl``, one strict-JSON object per trace (non-finite numbers are written as ``null``):

======================  ==================================================================================
key                     meaning
======================  ==================================================================================
``index``               position of the trace in the snapshot
``uid``                 group id (traces of one prompt share it)
``step``, ``estimator`` training step and advantage estimator of the snapshot
``prompt``              prompt text
``response``            response text (with special tokens)
``outcome``             verified reward ζ
``group_baseline``      mean outcome of the trace's uid group in the snapshot
``segmented``           true when the row carried segment data (``rredcot``, ``segment_mc``)
``segment_ends``        exclusive token indices into the response, strictly increasing, the last = response
                        length (in tokens); ``[len(response_tokens)]`` for rows without segment data
``segment_text``        the K segments' texts; joined they give the response (unless a byte-level token splits a
                        character: per-token strings then hold U+FFFD)
``raw_values``          probe values v̂_0..v̂_K (K+1 entries), or null
``values``              anchored values V_0..V_K (K+1 entries), or null (no segment data, or a trace that
                        fell back to its GRPO advantage)
``segment_rewards``     R_1..R_K (K entries; R_k = V_k − V_{k−1}), or null like ``values``
``response_tokens``     one decoded string per response token; joined they give the response
``token_advantages``    one advantage per response token
``edited_tokens``       IBPO: indices of the tokens the repair changed; null for other estimators
``ibpo_phi``            IBPO: the trace's shaped-reward coefficient φ; null for other estimators
``first_wrong_step``    1-based index of the first wrong step, from the task's ``first_wrong_step``
                        (arithmetic: the first wrong step line of the think block); null when every step is
                        right, the task has no such check, or the row's ``extra_info`` lacks what it needs
``first_wrong_segment`` 1-based k of the segment holding the start of that step line (its reward is R_k,
                        i.e. ``segment_rewards[k-1]``); null when ``first_wrong_step`` is null
``first_wrong_tokens``  ``[start, stop)`` token indices of that step (``start == stop``: the step is
                        missing and would start at token ``start``); null when ``first_wrong_step`` is null
======================  ==================================================================================

The task (``--task``, else the snapshot's ``task`` field, else ``arithmetic``: snapshots that do not record it
come from the embedded task) is a name or ``module:attr`` of ``rredcot_verl.tasks.resolve_task``.

Padding in the snapshot is stripped: ``seg_ends`` entries < 0, value/reward entries beyond K, mask entries beyond
the response, and response tokens after the last segment end (then ``response`` is the join of the kept tokens).
"""

from __future__ import annotations

import argparse
import bisect
import html
import itertools
import json
import math
import os
import re
import sys
import tempfile

from rredcot_verl.tasks.base import Task, resolve_task

SNAPSHOT_FILE = re.compile(r"step_(\d+)\.json")
REQUIRED_KEYS = ("uid", "prompt", "response", "response_tokens", "outcome", "token_advantages")


# ---------------------------------------------------------------------------------------------------------- snapshots


def _json_safe(value):
    """Plain JSON types; NaN/inf -> None; arrays and tensors (anything with ``tolist``) -> lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if hasattr(value, "tolist"):
        return _json_safe(value.tolist())
    return str(value)  # a snapshot must never stop training over an exotic extra_info field


def write_snapshot(directory: str, step: int, estimator: str, rows: list[dict], task: str | None = None) -> str:
    """Write ``directory/step_<step:05d>.json`` = ``{"step", "estimator", "task", "traces": rows}``; return its path.

    ``task``: the run's ``algorithm.rredcot.task``, which the report reads to locate first wrong steps.

    Atomic (temp file + rename), so a report never reads a half-written step. NaN/inf become null.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step:05d}.json")
    payload = _json_safe({"step": step, "estimator": estimator, "task": task, "traces": rows})
    handle, tmp_path = tempfile.mkstemp(dir=directory, prefix=".step_", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(payload, f, allow_nan=False, ensure_ascii=False)
        os.replace(tmp_path, path)
    except BaseException:
        os.unlink(tmp_path)
        raise
    return path


def latest_snapshot(path: str) -> str:
    """``path`` itself when it is a file, else the ``step_XXXXX.json`` with the highest step in that directory."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"snapshot {path!r} does not exist")
    steps = {int(m[1]): name for name in os.listdir(path) if (m := SNAPSHOT_FILE.fullmatch(name))}
    if not steps:
        raise FileNotFoundError(f"no step_XXXXX.json snapshot in directory {path!r}")
    return os.path.join(path, steps[max(steps)])


def load_snapshot(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"snapshot {path!r} is not valid JSON: {error}") from None


# ------------------------------------------------------------------------------------------------------------ records


def _floats(values, what: str) -> list[float]:
    """Numbers with null -> NaN (snapshots store NaN as null)."""
    if not isinstance(values, list) or not all(v is None or isinstance(v, (int, float)) for v in values):
        raise ValueError(f"{what} must be a list of numbers or nulls")
    return [math.nan if v is None else float(v) for v in values]


def _prefix(values: list[float], n: int, what: str) -> list[float]:
    if len(values) < n:
        raise ValueError(f"{what} has {len(values)} entries, need at least {n} for the row's segments")
    return values[:n]


def _all_nan_to_none(values: list[float] | None) -> list[float] | None:
    """A vector that is NaN everywhere (a GRPO-fallback trace) is reported as null rather than a list of nulls."""
    return None if values is None or all(math.isnan(v) for v in values) else values


def _segment_ends(row: dict, n_tokens: int, what: str) -> list[int] | None:
    if "seg_ends" not in row:
        return None
    ends = row["seg_ends"]
    if not isinstance(ends, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
        raise ValueError(f"{what}: seg_ends must be a list of integers")
    ends = [e for e in ends if e >= 0]  # -1 padding
    if any(b <= a for a, b in zip([0, *ends], ends)) or (ends and ends[-1] > n_tokens):
        raise ValueError(f"{what}: seg_ends {ends} must increase strictly within 1..{n_tokens} (the response length)")
    return ends


def tokens_in_span(tokens: list[str], start: int, stop: int) -> range:
    """Indices of the tokens overlapping characters [start, stop); an empty span gives an empty range at the token
    holding ``start`` (``len(tokens)`` past the end of the text)."""
    ends = list(itertools.accumulate(len(token) for token in tokens))
    first = bisect.bisect_right(ends, start)
    if stop <= start:
        return range(first, first)
    return range(first, bisect.bisect_left(ends, stop) + 1)


def _wrong_step(task: Task, extra_info, tokens: list[str]) -> tuple[int | None, range]:
    """(first wrong step, token indices of its text); (None, empty range) when all steps are right or unknown."""
    check = getattr(task, "first_wrong_step", None)
    found = None if check is None else check(extra_info, "".join(tokens))
    if found is None:
        return None, range(0)
    step, (start, stop) = found
    return step, tokens_in_span(tokens, start, stop)


def _segment_vector(row: dict, key: str, size: int | None, what: str) -> list[float] | None:
    """The first ``size`` entries of ``row[key]`` (the rest is padding); None when the row has no such key."""
    if key not in row:
        return None
    if size is None:
        raise ValueError(f"{what} has {key!r} but no 'seg_ends' to say how many segments it has")
    return _prefix(_floats(row[key], f"{what}: {key}"), size, f"{what}: {key}")


def _ibpo_phi(row: dict, what: str) -> float | None:
    phi = row.get("ibpo_phi")
    if isinstance(phi, list) and len(phi) == 1:  # a (1,)-shaped tensor's tolist()
        phi = phi[0]
    if phi is not None and not isinstance(phi, (int, float)):
        raise ValueError(f"{what}: ibpo_phi must be a number, got {phi!r}")
    return None if phi is None else float(phi)


def _record(row: dict, index: int, snapshot: dict, baselines: dict[str, float], task: Task) -> dict:
    what = f"trace {index}"
    tokens, advantages = row["response_tokens"], _floats(row["token_advantages"], f"{what}: token_advantages")
    if len(advantages) != len(tokens):
        raise ValueError(f"{what}: {len(advantages)} token_advantages for {len(tokens)} response_tokens")
    response = row["response"]
    ends = _segment_ends(row, len(tokens), what)
    if ends and ends[-1] < len(tokens):  # the last segment ends the real response: the rest is right padding
        tokens, advantages = tokens[: ends[-1]], advantages[: ends[-1]]
        response = "".join(tokens)
    k = None if ends is None else len(ends)
    segment_ends = [len(tokens)] if ends is None else ends
    edited = None
    if "ibpo_edited_mask" in row:
        mask = row["ibpo_edited_mask"]
        if not isinstance(mask, list):
            raise ValueError(f"{what}: ibpo_edited_mask must be a list of 0/1 flags")
        mask = _prefix(mask, len(tokens), f"{what}: ibpo_edited_mask")
        edited = [i for i, flag in enumerate(mask) if flag]
    step, wrong_tokens = _wrong_step(task, row.get("extra_info"), tokens)
    wrong_segment = None
    if step is not None and tokens and segment_ends:
        token = min(wrong_tokens.start, len(tokens) - 1)
        wrong_segment = next(number for number, end in enumerate(segment_ends, start=1) if token < end)
    return {
        "index": index,
        "uid": row["uid"],
        "step": snapshot.get("step"),
        "estimator": snapshot.get("estimator"),
        "prompt": row["prompt"],
        "response": response,
        "outcome": float(row["outcome"]),
        "group_baseline": baselines[row["uid"]],
        "segmented": ends is not None,
        "segment_ends": segment_ends,
        "segment_text": ["".join(tokens[a:b]) for a, b in zip([0, *segment_ends], segment_ends)],
        "raw_values": _segment_vector(row, "seg_raw_values", None if k is None else k + 1, what),
        "values": _all_nan_to_none(_segment_vector(row, "values", None if k is None else k + 1, what)),
        "segment_rewards": _all_nan_to_none(_segment_vector(row, "segment_rewards", k, what)),
        "response_tokens": tokens,
        "token_advantages": advantages,
        "edited_tokens": edited,
        "ibpo_phi": _ibpo_phi(row, what),
        "first_wrong_step": step,
        "first_wrong_segment": wrong_segment,
        "first_wrong_tokens": None if step is None else [wrong_tokens.start, wrong_tokens.stop],
    }


def _check_row(row, index: int) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"trace {index} is not an object")
    missing = [key for key in REQUIRED_KEYS if key not in row]
    if missing:
        raise ValueError(f"trace {index} lacks {missing}")
    for key in ("uid", "prompt", "response"):
        if not isinstance(row[key], str):
            raise ValueError(f"trace {index}: {key} must be a string, got {type(row[key]).__name__}")
    if not isinstance(row["response_tokens"], list) or not all(isinstance(t, str) for t in row["response_tokens"]):
        raise ValueError(f"trace {index}: response_tokens must be a list of strings")
    if not isinstance(row["outcome"], (int, float)) or not math.isfinite(row["outcome"]):
        raise ValueError(f"trace {index}: outcome must be a finite number, got {row['outcome']!r}")


def snapshot_task(snapshot: dict, name: str | None = None) -> Task:
    """The task named by ``name``, else by the snapshot's ``task`` field, else ``arithmetic`` (module docstring)."""
    recorded = snapshot.get("task") if isinstance(snapshot, dict) else None
    return resolve_task(name or recorded or "arithmetic")


def build_report(snapshot: dict, task: Task, max_traces: int | None = None) -> list[dict]:
    """One record per trace, with the keys of the JSONL schema above; ``task`` locates first wrong steps.

    Group baselines use every trace of the snapshot, also when ``max_traces`` keeps only the first ones.
    Raises ValueError naming the trace and field when the snapshot is malformed or holds no traces.
    """
    if max_traces is not None and max_traces < 1:
        raise ValueError(f"max_traces must be >= 1, got {max_traces}")
    traces = snapshot.get("traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list) or not traces:
        raise ValueError("snapshot holds no traces (expected a non-empty 'traces' list)")
    for index, row in enumerate(traces):
        _check_row(row, index)
    outcomes: dict[str, list[float]] = {}
    for row in traces:
        outcomes.setdefault(row["uid"], []).append(float(row["outcome"]))
    baselines = {uid: sum(values) / len(values) for uid, values in outcomes.items()}
    kept = traces if max_traces is None else traces[:max_traces]
    return [_record(row, index, snapshot, baselines, task) for index, row in enumerate(kept)]


# --------------------------------------------------------------------------------------------------------------- html

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
.legend { border: 1px solid #ccc; padding: .6em 1em; margin-bottom: 1.5em; line-height: 1.8; }
.bar { display: inline-block; width: 240px; height: 1em; vertical-align: middle;
       background: linear-gradient(to right, rgb(214,39,40), #fff, rgb(44,160,44)); border: 1px solid #999; }
.group { border-top: 3px solid #444; margin-top: 1.5em; }
.trace { border: 1px solid #ddd; margin: .8em 0; padding: .5em .8em; }
.trace header { font-weight: 600; margin-bottom: .3em; }
.prompt { color: #555; white-space: pre-wrap; margin-bottom: .4em; }
.response { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.9; }
.seg { display: inline-block; border-left: 3px solid #1f4e9c; padding: 0 .3em; margin: 0 .2em;
       font: 11px system-ui, sans-serif; color: #1f4e9c; background: #eef2fa; line-height: 1.3; }
.edited { text-decoration: underline 2px #5b2a86; outline: 1px dashed #5b2a86; }
.wrong { border-top: 2px solid #c00; border-bottom: 2px solid #c00; }
.badge { font: bold 11px system-ui, sans-serif; color: #fff; background: #c00; padding: 0 .3em; margin-right: .2em; }
.nan { background: repeating-linear-gradient(45deg, #bbb, #bbb 3px, #eee 3px, #eee 6px); }
"""


def _colour(advantage: float, scale: float) -> str:
    """White at 0, towards red (negative) or green (positive), full strength at |A| = scale."""
    strength = 0.85 * min(abs(advantage) / scale, 1.0)
    target = (214, 39, 40) if advantage < 0 else (44, 160, 44)
    r, g, b = (round(255 + (c - 255) * strength) for c in target)
    return f"rgb({r},{g},{b})"


def _number(value: float | None, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _segment_label(record: dict, k: int) -> str:
    values, rewards = record["values"], record["segment_rewards"]
    raw = record["raw_values"]
    parts = [f"§{k}" if k else "start"]
    if values is not None:
        parts.append(f"V{k} {_number(values[k])}")
    elif raw is not None:
        parts.append(f"v̂{k} {_number(raw[k])}")
    if k and rewards is not None:
        parts.append(f"R{k} {_number(rewards[k - 1], signed=True)}")
    return f'<span class="seg">{html.escape(" · ".join(parts))}</span>'


def _text_html(text: str) -> str:
    return html.escape(text).replace("\n", "<br>")


def _label_positions(tokens: list[str], segment_ends: list[int]) -> dict[int, list[int]]:
    """Token index -> the segments whose end label goes right before that token (``len(tokens)``: after the last).

    A label goes before its segment's trailing newline tokens, so that a line's label stays on that line.
    """
    positions, start = {}, 0
    for k, end in enumerate(segment_ends, start=1):
        position = end
        while position > start and "\n" in tokens[position - 1] and not tokens[position - 1].strip():
            position -= 1
        positions.setdefault(position, []).append(k)
        start = end
    return positions


def _response_html(record: dict, scale: float) -> str:
    tokens, advantages = record["response_tokens"], record["token_advantages"]
    edited = set(record["edited_tokens"] or ())
    wrong, badge = range(0), {}
    if record["first_wrong_step"] is not None:
        wrong = range(*record["first_wrong_tokens"])
        missing = "" if wrong else " missing"
        badge = {wrong.start: f'<span class="badge">⚠ step {record["first_wrong_step"]}{missing}</span>'}
    labels = _label_positions(tokens, record["segment_ends"]) if record["segmented"] else {}
    pieces = [_segment_label(record, 0)] if record["segmented"] else []
    for i in range(len(tokens) + 1):
        pieces.extend(_segment_label(record, k) for k in labels.get(i, ()))
        pieces.append(badge.get(i, ""))
        if i == len(tokens):
            break
        classes = [name for name, on in (("edited", i in edited), ("wrong", i in wrong)) if on]
        style = ""
        if math.isfinite(advantages[i]):
            style = f' style="background:{_colour(advantages[i], scale)}"'
        else:
            classes.append("nan")
        class_attr = f' class="{" ".join(classes)}"' if classes else ""
        title = f"token {i}: A={_number(advantages[i], signed=True)}"
        pieces.append(f'<span{class_attr}{style} title="{title}">{_text_html(tokens[i])}</span>')
    return "".join(pieces)


def _trace_html(record: dict, scale: float) -> str:
    mark = "✓" if record["outcome"] > 0 else "✗"
    header = [
        f"#{record['index']}",
        f"outcome {mark} {record['outcome']:g}",
        f"group baseline {_number(record['group_baseline'])}",
        f"estimator {record['estimator']}",
    ]
    if record["ibpo_phi"] is not None:
        header.append(f"φ {_number(record['ibpo_phi'])}")
    if record["first_wrong_step"] is not None:
        header.append(f"first wrong step {record['first_wrong_step']} (segment {record['first_wrong_segment']})")
    return (
        '<article class="trace">'
        f"<header>{html.escape(' · '.join(header))}</header>"
        f'<div class="prompt">{_text_html(record["prompt"])}</div>'
        f'<div class="response">{_response_html(record, scale)}</div>'
        "</article>"
    )


def render_html(records: list[dict], title: str) -> str:
    """One self-contained page: legend, then the traces grouped by uid (groups in order of first appearance)."""
    finite = [abs(a) for record in records for a in record["token_advantages"] if math.isfinite(a)]
    scale = max(finite, default=0.0) or 1.0
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["uid"], []).append(record)
    legend = (
        '<div class="legend">'
        f'Token background = advantage A: <b>{-scale:+.3f}</b> <span class="bar"></span> <b>{scale:+.3f}</b> '
        "(white = 0; scaled by the largest |A| on this page; hover a token for its value; "
        '<span class="nan">hatched</span> = non-finite).<br>'
        '<span class="seg">§k · V<sub>k</sub> · R<sub>k</sub></span> ends segment k (before its closing newline): '
        "V<sub>k</sub> = value after it (v̂<sub>k</sub>, the raw probe value, when there is no anchored value), "
        "R<sub>k</sub> = V<sub>k</sub> − V<sub>k−1</sub>. "
        '<span class="edited">underlined</span> = token changed by the IBPO repair. '
        '<span class="badge">⚠ step k</span><span class="wrong">framed</span> = first wrong step line '
        "(tasks with a step check, e.g. arithmetic).</div>"
    )
    sections = []
    for uid, members in groups.items():
        heading = f"group {uid} · {len(members)} trace(s) · baseline {_number(members[0]['group_baseline'])}"
        body = "".join(_trace_html(record, scale) for record in members)
        sections.append(f'<section class="group"><h2>{html.escape(heading)}</h2>{body}</section>')
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{legend}{''.join(sections)}</body></html>\n"
    )


# ---------------------------------------------------------------------------------------------------------------- cli


def write_report(snapshot: dict, out_dir: str, task: Task, max_traces: int | None = None) -> tuple[str, str]:
    """Write ``credit_report.jsonl`` and ``credit_report.html`` into ``out_dir``; return their paths."""
    records = build_report(snapshot, task, max_traces)
    os.makedirs(out_dir, exist_ok=True)
    jsonl_path = os.path.join(out_dir, "credit_report.jsonl")
    html_path = os.path.join(out_dir, "credit_report.html")
    with open(jsonl_path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(_json_safe(record), allow_nan=False, ensure_ascii=False) + "\n")
    title = f"Credit report · step {snapshot.get('step')} · {snapshot.get('estimator')}"
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(records, title))
    return jsonl_path, html_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rredcot_verl.report", description=__doc__.split("\n")[0])
    parser.add_argument("--snapshot", required=True, help="a step_XXXXX.json file, or a directory (its newest one)")
    parser.add_argument("--out", required=True, help="output directory for credit_report.jsonl and .html")
    parser.add_argument("--max-traces", type=int, default=None, help="report only the first N traces")
    parser.add_argument("--task", default=None,
                        help="task name or module:attr (default: the snapshot's task, else arithmetic)")
    args = parser.parse_args(argv)
    try:
        path = latest_snapshot(args.snapshot)
        snapshot = load_snapshot(path)
        jsonl_path, html_path = write_report(snapshot, args.out, snapshot_task(snapshot, args.task), args.max_traces)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    print(f"{path} -> {jsonl_path}, {html_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
