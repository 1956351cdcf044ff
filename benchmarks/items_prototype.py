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
at its first checkpoint inside the band. Then ``value_quality`` on each stage's model, on its own task: exit-probe values against
Monte-Carlo values (K continuations a state), within-trace Spearman and localisation of the first wrong item, the
screen's bars 0.6 and 60%. The screen itself (a build preset with its committed warm start, gradients, GRPO's own
rate) is the step after this one; this only says whether a warm start can get there.

    python -m benchmarks.items_prototype           # about 80 min on one core: results/items_prototype.json
    python -m benchmarks.items_prototype --smoke   # a minute: a few steps a stage, temp output

Each stage's model is kept under ``outputs/items_prototype/`` with its record and reused when its settings match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks import common, value_quality
from rredcot_verl.tasks.arithmetic import ArithmeticTaskConfig, write_parquet
from rredcot_verl.tasks.build import DEFAULT_N_TRAIN, DEFAULT_N_VAL, ITEMS_TASK, PRESETS
from rredcot_verl.tasks.model import load_model_dir
from rredcot_verl.tasks.sft import SFTConfig, train_warm_start

RESULTS_PATH = common.RESULTS_DIR / "items_prototype.json"
CACHE_DIR = common.ROOT / "outputs" / "items_prototype"
# Three-digit results of operands 10..999: responses of about 112 tokens (two-digit items: about 85).
THREE_DIGIT_ITEMS = ArithmeticTaskConfig(min_operand=10, max_operand=999, independent_items=7, item_digits=3)
MAX_RESPONSE_TOKENS = {2: common.SETTINGS["items"].max_response_length, 3: 192}
ITEMS_SFT = PRESETS["items"].sft


@dataclass(frozen=True)
class Stage:
    """One stage of SFT from the previous stage's model (the first from the items artefact)."""

    name: str
    task: ArithmeticTaskConfig
    sft: SFTConfig


def stages(smoke: bool) -> list[Stage]:
    # A lower peak rate than the warm start's 2e-3, for a model already trained; the band (1, 1) is never reached, so
    # stage 1 runs all its steps and keeps its most accurate checkpoint, the later among equals.
    train_on = replace(ITEMS_SFT, max_steps=2000, budget_s=1e9, lr=1e-3, warmup_steps=20, eval_every_steps=250,
                       n_eval=64, target_band=(1.0, 1.0))
    harder = replace(ITEMS_SFT, max_steps=1600, budget_s=1e9, lr=1e-3, warmup_steps=20, eval_every_steps=200,
                     n_eval=64, eval_max_new_tokens=MAX_RESPONSE_TOKENS[3])
    if smoke:
        train_on = replace(train_on, max_steps=4, eval_every_steps=2, n_eval=2, batch_size=4)
        harder = replace(harder, max_steps=4, eval_every_steps=2, n_eval=2, batch_size=4)
    return [Stage("trained_on", ITEMS_TASK, train_on), Stage("three_digit_items", THREE_DIGIT_ITEMS, harder)]


def run_stage(stage: Stage, source_dir: str, out_dir: Path) -> dict:
    """Train ``source_dir``'s model through ``stage`` into ``out_dir/model`` (reused when its record's settings
    match); returns the stage's record."""
    settings = {"source": str(source_dir), "task": stage.task.as_dict(), "sft": asdict(stage.sft)}
    settings = json.loads(json.dumps(settings))  # as the record stores them: tuples as lists
    record_path = out_dir / "record.json"
    if record_path.exists() and json.loads(record_path.read_text())["settings"] == settings:
        return json.loads(record_path.read_text())
    model, tokenizer = load_model_dir(str(source_dir))
    record = {"settings": settings, **train_warm_start(model, tokenizer, stage.task, stage.sft)}
    model.save_pretrained(out_dir / "model")
    tokenizer.save_pretrained(out_dir / "model")
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
    for stage in stages(args.smoke):
        folder = cache / stage.name
        record = run_stage(stage, source, folder)
        data_dir = folder / "data"
        write_parquet(str(data_dir), DEFAULT_N_TRAIN, DEFAULT_N_VAL, 0, stage.task)
        values = value_quality.run(folder, prompts, samples, mc_samples, seed=0, setting="items",
                                   model_dir=folder / "model",
                                   max_response_tokens=MAX_RESPONSE_TOKENS[stage.task.item_digits])
        result["stages"][stage.name] = {
            "task": stage.task.as_dict(), "sft": asdict(stage.sft), "source": str(source),
            "kept_step": record["kept"]["step"], "checkpoints": checkpoint_rows(record),
            "value_quality": {key: values[key] for key in ("states", "segments", "localisation_chance",
                                                           "localisation_traces", "traces", "exit_accuracy")},
            "per_trace": values["per_trace"],
        }
        common.print_table(checkpoint_rows(record), list(checkpoint_rows(record)[0]), f"{stage.name}: checkpoints")
        value_quality.print_tables(values)
        source = str(folder / "model")
    result["meta"] = {"prompts": prompts, "samples_per_prompt": samples, "mc_samples": mc_samples,
                      **common.machine_meta()}
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
