"""Capacity or training? The items warm start trained on until it answers after a forced exit, then a harder items
task warm-started from it: a prototype for the screen's condition (1), the policy valuing its own states.

The items warm start (``build --setting items``) stops at its first checkpoint in the sampled band (step 1000),
where its greedy answer after a forced exit is never exactly right and its exit-probe values rank states within a
trace below the screen's bar (RESULTS.md, "The screen"). Its training loss was still falling fast there. Stage 1
trains it on, on the same task and exit examples, 2000 steps, and keeps its most accurate checkpoint (sampled
accuracy, the later among equals); each checkpoint records greedy and sampled accuracy and the greedy exit accuracy by
items left (``tasks.sft.exit_accuracy``). A model trained that long writes whole traces nearly always right (no
reasoning task is left), so stage 2 trains the stage-1 model on items with three-digit results
(``ArithmeticTaskConfig.item_digits``), lines it still gets wrong, up to 1600 steps (its cosine ends there), stopping
at its first checkpoint inside the band. Then ``value_quality`` on each stage's model, on its own task: exit-probe
values against Monte-Carlo values (K continuations a state), within-trace Spearman and localisation of the first wrong
item, the screen's bars 0.6 and 60%. The screen itself (a build preset with its committed warm start, gradients,
GRPO's own rate) is the step after this one; this only says whether a warm start can get there.

    python -m benchmarks.items_prototype           # about 80 min on one core: results/items_prototype.json
    python -m benchmarks.items_prototype --smoke   # a minute: a few steps a stage, temp output

Each stage's model is kept under ``outputs/items_prototype/`` with its record and reused when its settings match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks import common, value_quality
from rredcot_verl.tasks.arithmetic import write_parquet
from rredcot_verl.tasks.build import DEFAULT_N_TRAIN, DEFAULT_N_VAL, PRESETS, Stage
from rredcot_verl.tasks.model import load_model_dir, save_model_dir
from rredcot_verl.tasks.sft import SFTConfig, train_warm_start

RESULTS_PATH = common.RESULTS_DIR / "items_prototype.json"
CACHE_DIR = common.ROOT / "outputs" / "items_prototype"
SETTING_BY_DIGITS = {2: "items", 3: "items3"}  # value_quality's setting of each stage's task
# The items3 preset's curriculum after its first stage (the committed items warm start), by cache folder.
STAGE_NAMES = ("trained_on", "three_digit_items")


def stages(smoke: bool) -> list[tuple[str, Stage]]:
    named = list(zip(STAGE_NAMES, PRESETS["items3"].stages[1:], strict=True))
    if smoke:
        named = [(name, replace(stage, sft=replace(stage.sft, max_steps=4, eval_every_steps=2, n_eval=2, batch_size=4)))
                 for name, stage in named]
    return named


def run_stage(stage: Stage, source_dir: str, out_dir: Path) -> dict:
    """Train ``source_dir``'s model through ``stage`` into ``out_dir/model`` (reused when its record's settings
    match); returns the stage's record."""
    settings = {"source": str(source_dir), "task": stage.task.as_dict(), "sft": asdict(stage.sft)}
    settings = json.loads(json.dumps(settings))  # as the record stores them: tuples as lists
    record_path = out_dir / "record.json"
    if record_path.exists():
        cached = json.loads(record_path.read_text())
        if cached["settings"] == settings:
            return cached
    model, tokenizer = load_model_dir(str(source_dir))
    record = {"settings": settings, **train_warm_start(model, tokenizer, stage.task, stage.sft)}
    save_model_dir(model, tokenizer, str(out_dir / "model"))
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def checkpoint_rows(record: dict) -> list[dict]:
    return [{"step": c["step"], "greedy": c["greedy"]["accuracy"], "sampled": c["sampled"]["accuracy"],
             **{f"exit_{left}_left": accuracy for left, accuracy in c["exit"]["by_steps_left"].items()}}
            for c in record["checkpoints"]]


def main(argv: list[str] | None = None) -> dict:
    cli = common.parser(__doc__, RESULTS_PATH, "a few steps a stage, 2 prompts x 2, MC K=4; temp output and cache",
                        build=False)
    cli.add_argument("--prompts", type=int, default=16)
    cli.add_argument("--mc-samples", type=int, default=16)
    args = cli.parse_args(argv)
    out = common.out_path(args, RESULTS_PATH)
    cache = out.parent / "items_prototype_cache" if args.smoke else CACHE_DIR
    prompts, samples, mc_samples = (2, 2, 4) if args.smoke else (args.prompts, 4, args.mc_samples)
    torch.set_num_threads(1)
    source, result = PRESETS["items"].artefact.model_dir, {"stages": {}}
    for name, stage in stages(args.smoke):
        folder = cache / name
        record = run_stage(stage, source, folder)
        checkpoints = checkpoint_rows(record)
        data_dir = folder / "data"
        write_parquet(str(data_dir), DEFAULT_N_TRAIN, DEFAULT_N_VAL, 0, stage.task)
        values = value_quality.run(folder, prompts, samples, mc_samples, seed=0,
                                   setting=SETTING_BY_DIGITS[stage.task.item_digits], model_dir=folder / "model")
        result["stages"][name] = {
            "task": stage.task.as_dict(), "sft": asdict(stage.sft), "source": str(source),
            "kept_step": record["kept"]["step"], "checkpoints": checkpoints,
            "value_quality": {key: values[key] for key in ("states", "segments", "localisation_chance",
                                                           "localisation_traces", "traces", "exit_accuracy")},
            "per_trace": values["per_trace"],
        }
        common.print_table(checkpoints, list(checkpoints[0]), f"{name}: checkpoints")
        value_quality.print_tables(values)
        source = str(folder / "model")
    result["meta"] = {"prompts": prompts, "samples_per_prompt": samples, "mc_samples": mc_samples,
                      **common.machine_meta()}
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
