"""Credit report: snapshot writing, JSONL schema and values, HTML page, CLI input handling.

Rows are built the way the trainer builds them: responses tokenised by the embedded task's real tokenizer and decoded
one token at a time, segment data padded with -1 / NaN, extra_info as the dataset stores it.
"""

import json
import os

import numpy as np
import pytest

from rredcot_verl import report
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, format_response, reference_response
from rredcot_verl.tasks.base import ARITHMETIC, PARAGRAPHS
from rredcot_verl.tasks.model import build_tokenizer

NAN = float("nan")
PROBLEM = ArithmeticProblem((23, 45, 17, 8), ("+", "-", "+"))  # 23+45=68, 68-17=51, 51+8=59
WRONG_SECOND = format_response(["23+45=68", "68-17=50", "50+8=58"], 58)  # step 2 is wrong
ONE_STEP_ONLY = format_response(["23+45=68"], 68)  # step 2 is missing


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _row(tokenizer, uid, text, outcome, advantages=None, extra_info=None, padding=0, **fields):
    """A snapshot row as ``trainer._write_snapshot`` writes it; ``padding`` appends right-padding tokens."""
    ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"] + [tokenizer.pad_token_id] * padding
    n_real = len(ids) - padding
    if advantages is None:
        advantages = [outcome - 0.5] * n_real
    return {
        "uid": uid,
        "prompt": PROBLEM.prompt,
        "response": tokenizer.decode(ids, skip_special_tokens=False),
        "response_tokens": [tokenizer.decode([i], skip_special_tokens=False) for i in ids],
        "outcome": outcome,
        "token_advantages": list(advantages) + [0.0] * padding,
        "extra_info": extra_info,
        **fields,
    }


def _segment_ends_at_newlines(row, kmax):
    """Exclusive ends after each newline token of the think block, then the response end, -1 padded to kmax."""
    tokens = row["response_tokens"]
    n_real = len([t for t in tokens if t != "<|pad|>"])
    ends = [i + 1 for i, token in enumerate(tokens[:n_real]) if token == "\n" and i + 1 < n_real][:3] + [n_real]
    return ends + [-1] * (kmax - len(ends))


def _strict_json(text):
    def reject(constant):
        raise AssertionError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [_strict_json(line) for line in f]


@pytest.fixture(scope="module")
def rows(tokenizer):
    extra = {
        "operands": np.array(PROBLEM.operands),  # as read back from parquet
        "ops": np.array(PROBLEM.ops, dtype=object),
        "reference_response": reference_response(PROBLEM),
    }
    grpo = _row(tokenizer, "a", reference_response(PROBLEM), 1.0)
    rredcot = _row(tokenizer, "a", WRONG_SECOND, 0.0, extra_info=extra, padding=3)
    rredcot["seg_ends"] = _segment_ends_at_newlines(rredcot, kmax=6)  # <think>, line 1, line 2, rest
    assert sum(end >= 0 for end in rredcot["seg_ends"]) == 4
    values = [1 / 3, 0.6, 0.6, 0.1, 0.0]  # V_0 = group mean, V_K = outcome; the drop is at the wrong line
    rredcot["seg_raw_values"] = [0.4, 0.6, 0.6, 0.1, 0.0, NAN, NAN]
    rredcot["values"] = values + [NAN, NAN]
    rredcot["segment_rewards"] = [b - a for a, b in zip(values, values[1:])] + [NAN, NAN]
    fallback = _row(tokenizer, "a", ONE_STEP_ONLY, 0.0, extra_info=extra, padding=1)
    fallback["seg_ends"] = _segment_ends_at_newlines(fallback, kmax=6)
    fallback["seg_raw_values"] = [0.5] * (sum(e >= 0 for e in fallback["seg_ends"]) + 1) + [NAN] * 2
    fallback["values"] = [NAN] * 7
    fallback["segment_rewards"] = [NAN] * 6
    ibpo = _row(tokenizer, "b", "<think>\n1+1=2\n</think>\n\\boxed{2}", 0.0, extra_info={"split": "train"})
    n = len(ibpo["response_tokens"])
    ibpo["ibpo_edited_mask"] = [0, 0, 1, 1] + [0] * (n - 4) + [0, 0]
    ibpo["ibpo_phi"] = 0.25
    correct = _row(tokenizer, "b", reference_response(PROBLEM), 1.0, extra_info=extra)
    return [grpo, rredcot, fallback, ibpo, correct]


@pytest.fixture(scope="module")
def report_files(rows, tmp_path_factory):
    snapshot_dir = str(tmp_path_factory.mktemp("snapshots"))
    report.write_snapshot(snapshot_dir, 3, "rredcot", rows, task="arithmetic")
    out_dir = str(tmp_path_factory.mktemp("report"))
    assert report.main(["--snapshot", snapshot_dir, "--out", out_dir]) == 0
    jsonl_path, html_path = (os.path.join(out_dir, f"credit_report.{ext}") for ext in ("jsonl", "html"))
    with open(html_path, encoding="utf-8") as f:
        page = f.read()
    return _read_jsonl(jsonl_path), page


def test_write_snapshot_is_strict_json_with_nulls_and_leaves_no_temp_file(rows, tmp_path):
    path = report.write_snapshot(str(tmp_path / "new" / "dir"), 7, "rredcot", rows)
    assert os.path.basename(path) == "step_00007.json"
    assert os.listdir(os.path.dirname(path)) == ["step_00007.json"]
    with open(path, encoding="utf-8") as f:
        snapshot = _strict_json(f.read())
    assert snapshot["step"] == 7 and snapshot["estimator"] == "rredcot" and len(snapshot["traces"]) == len(rows)
    assert snapshot["traces"][1]["seg_raw_values"][-1] is None
    assert snapshot["traces"][1]["extra_info"]["operands"] == list(PROBLEM.operands)


def test_jsonl_has_one_record_per_trace_with_group_baselines(report_files, rows):
    records, _ = report_files
    assert [r["index"] for r in records] == list(range(len(rows)))
    assert all(r["step"] == 3 and r["estimator"] == "rredcot" for r in records)
    assert [r["outcome"] for r in records] == [row["outcome"] for row in rows]
    assert [r["group_baseline"] for r in records] == pytest.approx([1 / 3] * 3 + [0.5] * 2)


def test_segment_padding_is_stripped_and_segments_join_back_to_the_response(report_files, rows):
    records, _ = report_files
    segmented = records[1]
    k = sum(end >= 0 for end in rows[1]["seg_ends"])
    n_real = len(rows[1]["response_tokens"]) - 3
    assert segmented["segmented"] and len(segmented["segment_ends"]) == k
    assert segmented["segment_ends"] == [e for e in rows[1]["seg_ends"] if e >= 0]
    assert segmented["segment_ends"][-1] == n_real == len(segmented["token_advantages"])
    assert "<|pad|>" not in segmented["response"] and segmented["response"].endswith("<|im_end|>")
    assert len(segmented["raw_values"]) == len(segmented["values"]) == k + 1
    assert segmented["values"] == pytest.approx(rows[1]["values"][: k + 1])
    assert segmented["segment_rewards"] == pytest.approx(rows[1]["segment_rewards"][:k])
    for record in records:
        assert "".join(record["segment_text"]) == record["response"] == "".join(record["response_tokens"])
        assert record["segment_ends"][-1] == len(record["response_tokens"]) == len(record["token_advantages"])


def test_rows_without_segment_data_and_fallback_rows(report_files, rows):
    records, _ = report_files
    grpo = records[0]
    assert not grpo["segmented"] and grpo["segment_ends"] == [len(rows[0]["response_tokens"])]
    assert grpo["raw_values"] is grpo["values"] is grpo["segment_rewards"] is grpo["edited_tokens"] is None
    assert grpo["first_wrong_step"] is None  # no extra_info: unknown
    fallback = records[2]
    assert fallback["values"] is None and fallback["segment_rewards"] is None  # all-NaN vectors of a fallback
    assert fallback["raw_values"] == [0.5] * len(fallback["segment_ends"]) + [0.5]


def test_ibpo_edited_tokens_and_phi(report_files):
    records, _ = report_files
    assert records[3]["edited_tokens"] == [2, 3] and records[3]["ibpo_phi"] == 0.25
    assert records[3]["first_wrong_step"] is None  # extra_info without operands: unknown, not a crash


def test_first_wrong_step_is_located_in_tokens_and_segments(report_files):
    records, _ = report_files
    wrong = records[1]
    assert wrong["first_wrong_step"] == 2
    start, stop = wrong["first_wrong_tokens"]
    assert "".join(wrong["response_tokens"][start:stop]) == "68-17=50"
    ends = wrong["segment_ends"]
    k = wrong["first_wrong_segment"]
    assert (ends[k - 2] if k > 1 else 0) <= start < ends[k - 1]
    assert "68-17=50" in wrong["segment_text"][k - 1]
    missing = records[2]  # one step written, the second is missing: located at </think>
    assert missing["first_wrong_step"] == 2
    start, stop = missing["first_wrong_tokens"]
    assert start == stop and missing["response_tokens"][start] == "</think>"
    assert records[4]["first_wrong_step"] is None and records[4]["first_wrong_segment"] is None


def test_html_page_shows_every_trace_escaped_and_self_contained(report_files, rows):
    records, page = report_files
    for record in records:
        assert f"#{record['index']} · outcome" in page
    assert "<think>" not in page and "&lt;think&gt;" in page and "&lt;|im_end|&gt;" in page
    assert "http" not in page and "<script" not in page and "<link" not in page and "src=" not in page
    assert page.count('class="trace"') == len(rows) and page.count('class="group"') == 2
    assert page.count("⚠ step 2") == 2 and "⚠ step 2 missing" in page
    start, stop = records[1]["first_wrong_tokens"]
    assert page.count('class="wrong" style') == stop - start == len("68-17=50")  # one token per character here
    assert page.count('class="edited" style') == len(records[3]["edited_tokens"])
    # segment labels carry V_k and R_k, and sit on their line, before its newline
    label = f'<span class="seg">§3 · V3 0.100 · R3 {0.1 - 0.6:+.3f}</span>'  # the wrong line's value drop
    assert label in page and page.index(">0</span>" + label) < page.index(label + '<span style="background')
    assert "<br>" in page
    scale = max(abs(a) for record in records for a in record["token_advantages"])
    for advantage in (-scale, scale):
        assert f"background:{report._colour(advantage, scale)}" in page


def test_colour_scale_is_symmetric_and_white_at_zero():
    assert report._colour(0.0, 2.0) == "rgb(255,255,255)"
    red, green = report._colour(-2.0, 2.0), report._colour(2.0, 2.0)
    r, g, _ = (int(c) for c in red[4:-1].split(","))
    assert r > g
    r, g, _ = (int(c) for c in green[4:-1].split(","))
    assert g > r
    assert report._colour(-5.0, 2.0) == red  # clipped at the page's scale


def test_directory_picks_the_newest_step_and_max_traces_limits(rows, tmp_path):
    directory = str(tmp_path / "snaps")
    report.write_snapshot(directory, 9, "grpo", rows[:1])
    report.write_snapshot(directory, 10, "rredcot", rows)
    report.write_snapshot(directory, 100000, "ibpo", rows[3:])
    assert report.latest_snapshot(directory).endswith("step_100000.json")
    os.remove(os.path.join(directory, "step_100000.json"))
    out = str(tmp_path / "out")
    assert report.main(["--snapshot", directory, "--out", out, "--max-traces", "2"]) == 0
    records = _read_jsonl(os.path.join(out, "credit_report.jsonl"))
    assert len(records) == 2 and records[0]["step"] == 10
    assert records[1]["group_baseline"] == pytest.approx(1 / 3)  # baseline from the whole group, not the kept rows


@pytest.mark.parametrize(
    "contents, message",
    [
        (None, "does not exist"),
        ("{not json", "not valid JSON"),
        ({"step": 1, "estimator": "grpo", "traces": []}, "no traces"),
        ({"step": 1, "estimator": "grpo", "traces": [{"uid": "a"}]}, "trace 0 lacks"),
    ],
)
def test_bad_input_exits_with_a_clear_message(tmp_path, capsys, contents, message):
    path = tmp_path / "step_00001.json"
    if contents is not None:
        path.write_text(contents if isinstance(contents, str) else json.dumps(contents))
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--snapshot", str(path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_malformed_rows_name_the_trace_and_field(rows):
    snapshot = {"step": 1, "estimator": "rredcot", "traces": [dict(rows[1], token_advantages=[0.0])]}
    with pytest.raises(ValueError, match="trace 0: 1 token_advantages for"):
        report.build_report(snapshot, ARITHMETIC)
    short_values = dict(rows[1], values=[0.5])
    with pytest.raises(ValueError, match="trace 0: values has 1 entries"):
        report.build_report({"traces": [short_values]}, ARITHMETIC)
    no_ends = {key: value for key, value in rows[1].items() if key != "seg_ends"}
    with pytest.raises(ValueError, match="no 'seg_ends'"):
        report.build_report({"traces": [no_ends]}, ARITHMETIC)
    with pytest.raises(ValueError, match="must increase strictly"):
        report.build_report({"traces": [dict(rows[1], seg_ends=[5, 3])]}, ARITHMETIC)
    assert report.build_report({"traces": [rows[0]]}, ARITHMETIC)[0]["group_baseline"] == rows[0]["outcome"]
    with pytest.raises(ValueError, match="max_traces must be >= 1"):
        report.build_report({"traces": [rows[0]]}, ARITHMETIC, max_traces=0)


def test_the_task_decides_where_first_wrong_steps_are_located(rows, tmp_path):
    """The report receives the task: a task without a step check flags nothing; the snapshot's task is the default,
    ``--task`` overrides it, and an unknown task is a command-line error."""
    wrong = rows[1]
    assert report.build_report({"traces": [wrong]}, ARITHMETIC)[0]["first_wrong_step"] == 2
    assert report.build_report({"traces": [wrong]}, PARAGRAPHS)[0]["first_wrong_step"] is None
    directory = str(tmp_path / "snapshots")
    report.write_snapshot(directory, 1, "rredcot", [wrong], task="paragraphs")
    for extra, expected in (([], None), (["--task", "arithmetic"], 2)):
        out = str(tmp_path / f"out{len(extra)}")
        assert report.main(["--snapshot", directory, "--out", out, *extra]) == 0
        assert _read_jsonl(os.path.join(out, "credit_report.jsonl"))[0]["first_wrong_step"] == expected
    with pytest.raises(SystemExit):
        report.main(["--snapshot", directory, "--out", str(tmp_path / "bad"), "--task", "no_such_task"])
