"""Build a testbed: ``DIR/data/*.parquet``, ``DIR/model/`` (tokenizer + warm-started weights) and ``DIR/build.json``.

    python -m rredcot_verl.tasks.build --out DIR [--setting NAME] [--problems N] [--threads T]
                                       [--force] [--retrain [--update-artefact]]

Every testbed is a ``Testbed`` (``testbed(setting)``), built by the one ``build``:

- ``default``, ``long``, ``early``, ``items``, ``items3``: the embedded task (``tasks/arithmetic.py``) on a tiny Qwen2
  (``PRESETS``).
  ``default``: 2-5-step chains of operands 1..99, about 45-token traces. ``long``: 16-17-step chains of operands 1..9,
  each line restating the terms still to add (median reference response about 390 tokens), on a model whose positions
  fit it (``docs/choices.md``, "Long setting"). ``early``: the answer-early setting (``EARLY_TASK``). ``items``:
  seven independent items a trace, answered as their results written one after another (``ITEMS_TASK``). ``items3``:
  the same with three-digit results, warm-started through a curriculum from the items task (``Preset.curriculum``).
- ``qwen3``, ``r1_distill``, ``qwen2_5``, ``qwen3_gsm8k``: miniature stand-ins of the paper and quickstart model
  families (``tasks/miniature.py``; data in ``data/{train,test}.parquet``).
- ``calculator``: the calculator task for verl's tool agent loop (``tasks/calculator_miniature.py``), plus
  ``DIR/tools.yaml``.
- ``code``: function-writing problems judged in the sandbox (``tasks/code_miniature.py``).

Nothing is built twice. ``build.json`` records a fingerprint of what determines the data and one of what determines
the model: a folder whose fingerprints match is reused whole, a model whose fingerprint matches is kept when only the
data changed, and ``--force`` ignores the folder. A warm start that takes many minutes to train is a committed
artefact (``Artefact``, under ``tasks/assets/``): when its recorded fingerprint matches it is copied instead of
trained; ``--retrain`` trains anyway, and with ``--update-artefact`` the result replaces the artefact (how it is
reproduced). The artefacts' fingerprints carry a version (``BUILD_VERSION`` here, ``calculator_miniature``'s): bump
it when a change to the generator, tokenizer, model or warm start would change what gets built. The miniature and code
testbeds train in seconds or minutes and fingerprint the bytes of their sources instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Callable

from rredcot_verl.tasks import calculator_miniature, code_miniature, miniature
from rredcot_verl.tasks.arithmetic import ArithmeticTaskConfig, write_parquet
from rredcot_verl.tasks.model import TinyModelConfig, build_model, build_tokenizer, load_model_dir, save_model_dir
from rredcot_verl.tasks.sft import ExitExamples, SFTConfig, train_warm_start

BUILD_VERSION = 1
BUILD_RECORD = "build.json"
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_N_TRAIN = 4096
DEFAULT_N_VAL = 256
# 16-17 steps of one-digit operands, each step line restating the terms still to add: a median reference response of
# about 390 tokens. The restatement makes every step a local copy (the next operand is the first term of the line
# above), which a 3-layer model learns; finding the k-th of 40 operands in the prompt it did not (docs/choices.md).
LONG_TASK = ArithmeticTaskConfig(min_operand=1, max_operand=9, min_operands=17, max_operands=18,
                                 restate_remaining_terms=True)
# Two steps of operands 1..99 with the restated terms: after a forced exit the warm start computes one step in its
# head (never two: docs/choices.md, "Answer-early setting"), so from every state but the prompt the exit probe
# reads the answer the written lines lead to.
EARLY_TASK = ArithmeticTaskConfig(min_operand=1, max_operand=99, min_operands=3, max_operands=3,
                                  restate_remaining_terms=True)
# Seven independent items a±b of operands 1..49 with two-digit results (tasks/arithmetic.py, ``ItemsProblem``): seven
# decisions a trace, and from any state the answer is the lines written plus the items left, one step of work each
# (docs/choices.md, "Items setting").
ITEMS_TASK = ArithmeticTaskConfig(min_operand=1, max_operand=49, independent_items=7)
# The same seven items with three-digit results of operands 10..999 (answers of 21 digits, responses of about 112
# tokens): lines the items warm start, trained on until it answers after a forced exit, still gets wrong
# (docs/choices.md, "Three-digit items").
THREE_DIGIT_ITEMS_TASK = ArithmeticTaskConfig(min_operand=10, max_operand=999, independent_items=7, item_digits=3)
Log = Callable[[str], None]


@dataclass(frozen=True)
class Artefact:
    """A committed warm start: the model folder ``folder/model`` and ``folder/record``, a JSON object holding the
    ``fingerprint`` it was built for and the warm start's record."""

    folder: str
    model: str = "."
    record: str = "warmstart.json"

    @property
    def model_dir(self) -> str:
        return os.path.normpath(os.path.join(self.folder, self.model))


@dataclass(frozen=True)
class Testbed:
    """One testbed's build, declared; the callables are its task module's code.

    Attributes:
        name: its ``--setting``.
        data_fingerprint, model_fingerprint: what determines the data and the model (JSON objects).
        write_data: ``data_dir -> data``: writes the parquet files (and the rest of ``files``), deterministically;
            returns what ``train`` and ``measure`` read.
        train: ``(data, model_dir, log) -> record``: makes the tokenizer and model, warm-starts and saves them;
            returns the warm start's record.
        measure: ``(data, model_dir) -> dict``: what ``build.json`` says of the data and model (token lengths for
            verl's max_prompt_length / max_response_length, sizes).
        files: what the build writes besides ``model/``, relative to its folder.
        artefact: the committed warm start, if any.
        threads: torch threads the command trains with unless told.
    """

    name: str
    data_fingerprint: dict
    model_fingerprint: dict
    write_data: Callable[[str], Any]
    train: Callable[[Any, str, Log], dict]
    measure: Callable[[Any, str], dict]
    files: tuple[str, ...] = ("data/train.parquet", "data/val.parquet")
    artefact: Artefact | None = None
    threads: int = 1


# ------------------------------------------------------------------------------------------- the embedded task
@dataclass(frozen=True)
class Stage:
    """One stage of a warm-start curriculum: a task and the SFT run on it."""

    task: ArithmeticTaskConfig
    sft: SFTConfig


@dataclass(frozen=True)
class Preset:
    """A setting of the embedded task: the task, the model's shape, the warm start, and its shipped artefact.

    ``curriculum``: stages trained in order before the warm start's own (``task``, ``sft``), each from the kept
    checkpoint of the one before; the tokenizer is trained on the first stage's task.
    """

    task: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    artefact: Artefact = Artefact(os.path.join(ASSETS, "warmstart"))
    curriculum: tuple[Stage, ...] = ()

    @property
    def stages(self) -> tuple[Stage, ...]:
        return (*self.curriculum, Stage(self.task, self.sft))


ITEMS_SFT = SFTConfig(max_steps=4000, budget_s=1500.0, eval_every_steps=100, n_eval=128, eval_max_new_tokens=128,
                      target_band=(0.2, 0.5),
                      exit_examples=ExitExamples(fraction=0.5, steps_left_weights=(1.0,), slip_fraction=0.5))
PRESETS = {
    "default": Preset(),
    # Positions for a 45-token prompt and responses cut at 512 tokens; shorter batches of longer sequences (about the
    # default's tokens per step); evaluation generates whole traces.
    "long": Preset(LONG_TASK, TinyModelConfig(max_position_embeddings=1024),
                   SFTConfig(max_steps=6000, budget_s=2400.0, batch_size=16, eval_every_steps=100, n_eval=64,
                             eval_max_new_tokens=512, target_band=(0.2, 0.5)),
                   Artefact(os.path.join(ASSETS, "warmstart_long"))),
    # Answer-early examples (cut references, the exit text unlearned, half of them after a slipped line) beside the
    # whole references; checkpoints every 100 steps, since sampled accuracy crosses the band within a few hundred;
    # the band's upper part of 20-50%, where the one-step answer after an exit is sharper (docs/choices.md).
    "early": Preset(EARLY_TASK, TinyModelConfig(),
                    SFTConfig(max_steps=3000, budget_s=1800.0, eval_every_steps=100, eval_max_new_tokens=64,
                              target_band=(0.3, 0.5),
                              exit_examples=ExitExamples(fraction=0.5, steps_left_weights=(3.0, 1.0),
                                                         slip_fraction=0.5)),
                    Artefact(os.path.join(ASSETS, "warmstart_early"))),
    # Answer-early examples cut anywhere (every item left is one step of work), half of them after a slipped line;
    # answers of 14 digits.
    "items": Preset(ITEMS_TASK, TinyModelConfig(), ITEMS_SFT, Artefact(os.path.join(ASSETS, "warmstart_items"))),
    # The items warm start trained on its own task until it answers after a forced exit (stage 2: 2000 steps at a
    # lower peak rate, keeping the most accurate checkpoint, since the band (1, 1) is never reached), then on
    # three-digit items until its sampled accuracy enters the band (docs/choices.md, "Three-digit items").
    "items3": Preset(THREE_DIGIT_ITEMS_TASK, TinyModelConfig(),
                     replace(ITEMS_SFT, max_steps=1600, budget_s=1e9, lr=1e-3, warmup_steps=20, eval_every_steps=200,
                             n_eval=64, eval_max_new_tokens=192),
                     Artefact(os.path.join(ASSETS, "warmstart_items3")),
                     curriculum=(Stage(ITEMS_TASK, ITEMS_SFT),
                                 Stage(ITEMS_TASK, replace(ITEMS_SFT, max_steps=2000, budget_s=1e9, lr=1e-3,
                                                           warmup_steps=20, eval_every_steps=250, n_eval=64,
                                                           target_band=(1.0, 1.0))))),
}


def data_fingerprint(task: ArithmeticTaskConfig, n_train: int, n_val: int, seed: int) -> dict:
    return {"build_version": BUILD_VERSION, "task": task.as_dict(), "n_train": n_train, "n_val": n_val, "seed": seed}


def model_fingerprint(task: ArithmeticTaskConfig, model: TinyModelConfig, sft: SFTConfig,
                      curriculum: tuple[Stage, ...] = ()) -> dict:
    # Answer-early examples and curricula came after the first artefacts: they enter the fingerprint only when set,
    # so those artefacts (built without them) still match.
    def sft_settings(config: SFTConfig) -> dict:
        return {key: value for key, value in asdict(config).items() if key != "exit_examples" or value is not None}

    earlier = {"curriculum": [{"task": stage.task.as_dict(), "sft": sft_settings(stage.sft)} for stage in curriculum]}
    return {"build_version": BUILD_VERSION, "task": task.as_dict(), "model": model.as_dict(), "sft": sft_settings(sft),
            **(earlier if curriculum else {})}


def _train_arithmetic(preset: Preset, data, model_dir: str, log: Log) -> dict:
    stages = preset.stages
    tokenizer = build_tokenizer(preset.model, stages[0].task)
    model = build_model(tokenizer, preset.model)
    records = []
    for number, stage in enumerate(stages, 1):
        log(f"warm start, stage {number} of {len(stages)}: SFT up to {stage.sft.max_steps} steps / "
            f"{stage.sft.budget_s:.0f} s")
        records.append(train_warm_start(model, tokenizer, stage.task, stage.sft))
    save_model_dir(model, tokenizer, model_dir)
    record = {**records[-1], **({"curriculum": records[:-1]} if preset.curriculum else {})}
    kept = record["kept"]
    log(f"warm start: {record['total_steps']} steps in {record['total_seconds']:.0f} s; kept step {kept['step']}: "
        f"sampled accuracy {kept['sampled']['accuracy']:.1%}, greedy {kept['greedy']['accuracy']:.1%} "
        f"({'inside' if record['in_target_band'] else 'outside'} the target band {preset.sft.target_band})")
    return record


def _measure_arithmetic(data: tuple[str, str], model_dir: str) -> dict:
    """Longest chat prompt and reference response in tokens, for verl's max_prompt_length / max_response_length."""
    import pandas as pd

    from rredcot_verl.tasks.model import chat_prompt_ids, response_ids

    _, tokenizer = load_model_dir(model_dir, with_model=False)
    frame = pd.read_parquet(data[0])
    prompts = [chat_prompt_ids(tokenizer, messages[0]["content"]) for messages in frame["prompt"]]
    responses = [response_ids(tokenizer, info["reference_response"]) for info in frame["extra_info"]]
    return {"max_prompt_tokens": max(map(len, prompts)), "max_reference_response_tokens": max(map(len, responses))}


def arithmetic_testbed(name: str, preset: Preset, n_train: int | None = None, n_val: int = DEFAULT_N_VAL,
                       seed: int = 0) -> Testbed:
    n_train = n_train or DEFAULT_N_TRAIN
    return Testbed(
        name, data_fingerprint(preset.task, n_train, n_val, seed),
        model_fingerprint(preset.task, preset.model, preset.sft, preset.curriculum),
        write_data=lambda data_dir: write_parquet(data_dir, n_train, n_val, seed, preset.task),
        train=partial(_train_arithmetic, preset), measure=_measure_arithmetic, artefact=preset.artefact,
    )


# ------------------------------------------------------------------------------------------------- all testbeds
def _miniature(family: str, problems: int | None = None) -> Testbed:
    config = miniature.MiniatureConfig()
    fingerprint = miniature.fingerprint(family, problems, config)
    return Testbed(family, fingerprint, fingerprint, partial(miniature.write_family_data, family, problems, config),
                   partial(miniature.train, family, config), partial(miniature.measure, family),
                   files=("data/train.parquet", "data/test.parquet"), threads=2)


def _calculator(problems: int | None = None) -> Testbed:
    config = calculator_miniature.CalculatorBuildConfig()
    config = replace(config, n_train=problems) if problems else config
    model_config = miniature.MiniatureConfig()
    fingerprint = calculator_miniature.fingerprint(config, model_config)
    return Testbed("calculator", fingerprint, fingerprint, partial(calculator_miniature.write_data, config),
                   partial(calculator_miniature.train, config, model_config), calculator_miniature.measure,
                   files=("data/train.parquet", "data/val.parquet", calculator_miniature.TOOLS_FILE),
                   artefact=Artefact(calculator_miniature.ARTEFACT_DIR, "model", "calculator.json"), threads=2)


def _code(problems: int | None = None) -> Testbed:
    problems, config, sft = problems or 400, miniature.MiniatureConfig(), code_miniature.CodeSFTConfig()
    fingerprint = code_miniature.fingerprint(problems, config, sft)
    return Testbed("code", fingerprint, fingerprint, partial(code_miniature.write_problems, problems, config.seed),
                   partial(code_miniature.train, config, sft), code_miniature.measure)


SETTINGS: dict[str, Callable[[int | None], Testbed]] = {
    **{name: partial(arithmetic_testbed, name, preset) for name, preset in PRESETS.items()},
    **{family: partial(_miniature, family) for family in miniature.ALL_FAMILIES},
    "calculator": _calculator,
    "code": _code,
}


def testbed(setting: str = "default", problems: int | None = None) -> Testbed:
    """The testbed of ``setting`` (``SETTINGS``); ``problems`` resizes its data (the embedded task's training prompts,
    the first N shipped problems of a miniature family, the calculator's training rows, the code task's problems)."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; known: {sorted(SETTINGS)}")
    return SETTINGS[setting](problems)


# ---------------------------------------------------------------------------------------------------- the builder
def _json(value):
    """``value`` as it reads back from JSON (tuples become lists), so fingerprints compare equal to stored ones."""
    return json.loads(json.dumps(value))


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _loads(model_dir: str) -> bool:
    try:
        load_model_dir(model_dir, with_model=False)
    except (FileNotFoundError, ValueError):
        return False
    return True


def shipped_warm_start(bed: Testbed) -> dict | None:
    """The committed artefact's record when its fingerprint is the testbed's model fingerprint and its model folder
    loads; None otherwise."""
    if bed.artefact is None:
        return None
    record = _read_json(os.path.join(bed.artefact.folder, bed.artefact.record))
    matches = record is not None and record.get("fingerprint") == _json(bed.model_fingerprint)
    return record if matches and _loads(bed.artefact.model_dir) else None


def build(bed: Testbed, out_dir: str, force: bool = False, retrain: bool = False, update_artefact: bool = False,
          log: Log = print) -> dict:
    """Build (or reuse) ``bed`` under ``out_dir``; returns the record written to ``build.json``.

    ``update_artefact`` requires ``retrain``: the artefact must come from a training run, never from a cache.
    """
    if update_artefact and not retrain:
        raise ValueError("update_artefact needs retrain: the committed artefact must come from a fresh training run")
    if update_artefact and bed.artefact is None:
        raise ValueError(f"{bed.name} has no committed artefact to update")
    out_dir = os.path.abspath(out_dir)
    data_dir, model_dir = os.path.join(out_dir, "data"), os.path.join(out_dir, "model")
    fingerprints = {"data_fingerprint": _json(bed.data_fingerprint), "model_fingerprint": _json(bed.model_fingerprint)}
    previous = None if force else _read_json(os.path.join(out_dir, BUILD_RECORD))
    if previous is None or previous.get("setting") != bed.name:
        previous = {}
    model_cached = previous.get("model_fingerprint") == fingerprints["model_fingerprint"] and _loads(model_dir)
    if (not retrain and model_cached and previous.get("data_fingerprint") == fingerprints["data_fingerprint"]
            and all(os.path.isfile(os.path.join(out_dir, name)) for name in bed.files)):
        log(f"{bed.name}: reusing {out_dir} (settings unchanged)")
        return previous
    start = time.monotonic()
    data = bed.write_data(data_dir)
    log(f"{bed.name}: wrote {data_dir}")
    if not retrain and model_cached:
        source, warm_start = "cached", previous["warm_start"]
        log(f"{bed.name}: reusing {model_dir} (model settings unchanged)")
    elif not retrain and (shipped := shipped_warm_start(bed)) is not None:
        source, warm_start = "artefact", {key: value for key, value in shipped.items() if key != "fingerprint"}
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.copytree(bed.artefact.model_dir, model_dir)
        log(f"{bed.name}: copied the committed warm start {bed.artefact.folder} (--retrain trains instead)")
    else:
        source = "trained"
        shutil.rmtree(model_dir, ignore_errors=True)
        warm_start = bed.train(data, model_dir, log)
        if update_artefact:
            shutil.rmtree(bed.artefact.folder, ignore_errors=True)
            shutil.copytree(model_dir, bed.artefact.model_dir)
            with open(os.path.join(bed.artefact.folder, bed.artefact.record), "w") as f:
                json.dump({"fingerprint": fingerprints["model_fingerprint"], **warm_start}, f, indent=2)
            log(f"{bed.name}: replaced the committed artefact {bed.artefact.folder}")
    import torch

    record = _json({"setting": bed.name, **fingerprints, "model_source": source, "data_dir": data_dir,
                    "model_dir": model_dir, **bed.measure(data, model_dir), "warm_start": warm_start,
                    "seconds": round(time.monotonic() - start, 1), "torch_threads": torch.get_num_threads()})
    with open(os.path.join(out_dir, BUILD_RECORD), "w") as f:
        json.dump(record, f, indent=2)
    return record


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description="Build a testbed: parquet data + warm-started model + build.json.")
    parser.add_argument("--out", required=True, help="output folder (data/, model/, build.json)")
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="default", help="the testbed (SETTINGS)")
    parser.add_argument("--problems", type=int, default=None, help="resize the data (default: the setting's; see "
                        "rredcot_verl.tasks.build.testbed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the warm start (default: the "
                        "setting's: 1 where it trains for minutes on a shared machine, else 2)")
    parser.add_argument("--force", action="store_true", help="ignore the folder's cached data and model")
    parser.add_argument("--retrain", action="store_true", help="train the warm start even if the artefact matches")
    parser.add_argument("--update-artefact", action="store_true",
                        help="with --retrain: replace the committed artefact with the new warm start")
    args = parser.parse_args(argv)
    if args.update_artefact and not args.retrain:
        parser.error("--update-artefact needs --retrain: the committed artefact must come from a fresh training run")
    bed = testbed(args.setting, args.problems)
    torch.set_num_threads(args.threads or bed.threads)
    record = build(bed, args.out, force=args.force, retrain=args.retrain, update_artefact=args.update_artefact)
    print(json.dumps({key: value for key, value in record.items() if not key.endswith("fingerprint")
                      and key != "warm_start"}, indent=2))


if __name__ == "__main__":
    main()
