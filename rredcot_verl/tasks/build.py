"""Build the embedded default: ``DIR/data/{train,val}.parquet`` and ``DIR/model/`` (tokenizer + warm-started weights).

    python -m rredcot_verl.tasks.build --out DIR [--setting default|long] [--n-train N] [--n-val N] [--seed S]
                                       [--sft-steps N] [--sft-budget-s S] [--threads T]
                                       [--force] [--retrain] [--update-artefact]

``--setting`` picks a preset (``PRESETS``): the task, the model's shape, the warm start and the shipped artefact.
``default`` is the embedded task (2-5-step chains of operands 1..99, about 45-token traces); ``long`` is its long
setting (16-17-step chains of operands 1..9, each line restating the terms still to add, median reference response
about 390 tokens) on a model of its own whose positions fit it (``LONG_TASK``; ``docs/choices.md``, "Long setting").

The warm start is most of the demo's cost (about 17 core-minutes or more), so nothing is built twice:
- ``DIR/build.json`` records a fingerprint of the settings for the data and for the model; a part whose fingerprint
  matches is reused (and the command says so). ``--force`` rebuilds both.
- The package ships the warm-started model as a committed artefact (``tasks/assets/warmstart/``). When its
  fingerprint matches the requested settings it is copied instead of training. ``--retrain`` trains anyway, and
  with ``--update-artefact`` the result replaces the artefact: this is how the artefact is reproduced.

Bump ``BUILD_VERSION`` when a change to the generator, tokenizer, model or SFT would change what gets built: it is
part of every fingerprint, so stale folders and a stale artefact stop matching.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, replace

from rredcot_verl.tasks.arithmetic import ArithmeticTaskConfig, write_parquet
from rredcot_verl.tasks.model import TinyModelConfig, build_model, build_tokenizer, load_model_dir, save_model_dir
from rredcot_verl.tasks.sft import WARMSTART_RECORD, ExitExamples, SFTConfig, train_warm_start, write_record

BUILD_VERSION = 1
BUILD_RECORD = "build.json"
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
ARTEFACT_DIR = os.path.join(ASSETS, "warmstart")
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


@dataclass(frozen=True)
class Preset:
    """What a setting's build is made of: the task, the model's shape, the warm start, and its shipped artefact."""

    task: ArithmeticTaskConfig = field(default_factory=ArithmeticTaskConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    artefact_dir: str = ARTEFACT_DIR


PRESETS = {
    "default": Preset(),
    # Positions for a 45-token prompt and responses cut at 512 tokens; shorter batches of longer sequences (about the
    # default's tokens per step); evaluation generates whole traces.
    "long": Preset(LONG_TASK, TinyModelConfig(max_position_embeddings=1024),
                   SFTConfig(max_steps=6000, budget_s=2400.0, batch_size=16, eval_every_steps=100, n_eval=64,
                             eval_max_new_tokens=512, target_band=(0.2, 0.5)),
                   os.path.join(ASSETS, "warmstart_long")),
    # Answer-early examples (cut references, the exit text unlearned, half of them after a slipped line) beside the
    # whole references; checkpoints every 100 steps, since sampled accuracy crosses the band within a few hundred;
    # the band's upper part of 20-50%, where the one-step answer after an exit is sharper (docs/choices.md).
    "early": Preset(EARLY_TASK, TinyModelConfig(),
                    SFTConfig(max_steps=3000, budget_s=1800.0, eval_every_steps=100, eval_max_new_tokens=64,
                              target_band=(0.3, 0.5),
                              exit_examples=ExitExamples(fraction=0.5, steps_left_weights=(3.0, 1.0),
                                                         slip_fraction=0.5)),
                    os.path.join(ASSETS, "warmstart_early")),
}


def data_fingerprint(task: ArithmeticTaskConfig, n_train: int, n_val: int, seed: int) -> dict:
    return {"build_version": BUILD_VERSION, "task": asdict(task), "n_train": n_train, "n_val": n_val, "seed": seed}


def model_fingerprint(task: ArithmeticTaskConfig, model: TinyModelConfig, sft: SFTConfig) -> dict:
    # Answer-early examples came after the default and long artefacts: they enter the fingerprint only when set, so
    # those artefacts (built without them) still match.
    sft_settings = {key: value for key, value in asdict(sft).items() if key != "exit_examples" or value is not None}
    # json round trip so tuples compare equal to the lists read back from disk
    return json.loads(json.dumps(
        {"build_version": BUILD_VERSION, "task": asdict(task), "model": model.as_dict(), "sft": sft_settings}
    ))


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _model_fingerprint_in(model_dir: str) -> dict | None:
    record = _read_json(os.path.join(model_dir, WARMSTART_RECORD))
    return None if record is None else record.get("fingerprint")


def _usable_model_dir(model_dir: str, fingerprint: dict) -> bool:
    if _model_fingerprint_in(model_dir) != fingerprint:
        return False
    try:
        load_model_dir(model_dir, with_model=False)
    except (FileNotFoundError, ValueError):
        return False
    return True


def _token_lengths(tokenizer, train_path: str) -> dict:
    """Longest chat prompt and reference response in tokens, for verl's max_prompt_length / max_response_length."""
    import pandas as pd

    from rredcot_verl.tasks.model import chat_prompt_ids, response_ids

    frame = pd.read_parquet(train_path)
    prompts = [chat_prompt_ids(tokenizer, messages[0]["content"]) for messages in frame["prompt"]]
    responses = [response_ids(tokenizer, info["reference_response"]) for info in frame["extra_info"]]
    return {"max_prompt_tokens": max(map(len, prompts)), "max_reference_response_tokens": max(map(len, responses))}


def build(
    out_dir: str,
    task: ArithmeticTaskConfig = ArithmeticTaskConfig(),
    model_config: TinyModelConfig = TinyModelConfig(),
    sft: SFTConfig = SFTConfig(),
    n_train: int = DEFAULT_N_TRAIN,
    n_val: int = DEFAULT_N_VAL,
    seed: int = 0,
    force: bool = False,
    retrain: bool = False,
    update_artefact: bool = False,
    artefact_dir: str = ARTEFACT_DIR,
    log=print,
) -> dict:
    """Build (or reuse) the data and model under ``out_dir``; returns the build record written to ``build.json``.

    ``update_artefact`` requires ``retrain``: the artefact must come from a training run, never from a cache.
    """
    if update_artefact and not retrain:
        raise ValueError("update_artefact needs retrain: the committed artefact must come from a fresh training run")
    out_dir = os.path.abspath(out_dir)
    data_dir, model_dir = os.path.join(out_dir, "data"), os.path.join(out_dir, "model")
    train_path, val_path = os.path.join(data_dir, "train.parquet"), os.path.join(data_dir, "val.parquet")
    previous = None if force else _read_json(os.path.join(out_dir, BUILD_RECORD))
    data_fp = data_fingerprint(task, n_train, n_val, seed)
    model_fp = model_fingerprint(task, model_config, sft)

    if previous and previous.get("data_fingerprint") == data_fp and all(map(os.path.isfile, (train_path, val_path))):
        log(f"data: reusing {data_dir} (settings unchanged)")
    else:
        write_parquet(data_dir, n_train, n_val, seed, task)
        log(f"data: wrote {train_path} ({n_train} rows) and {val_path} ({n_val} rows)")

    if not force and not retrain and _usable_model_dir(model_dir, model_fp):
        model_source = "cached"
        log(f"model: reusing {model_dir} (settings unchanged)")
    elif not retrain and _usable_model_dir(artefact_dir, model_fp):
        model_source = "artefact"
        if os.path.isdir(model_dir):
            shutil.rmtree(model_dir)
        shutil.copytree(artefact_dir, model_dir)
        log(f"model: copied the committed warm start from {artefact_dir} (use --retrain to train instead)")
    else:
        model_source = "trained"
        if not retrain:
            log(f"model: no cached model or committed artefact matches these settings; training (SFT up to "
                f"{sft.max_steps} steps / {sft.budget_s:.0f} s)")
        tokenizer = build_tokenizer(model_config, task)
        model = build_model(tokenizer, model_config)
        record = train_warm_start(model, tokenizer, task, sft)
        record["fingerprint"] = model_fp
        save_model_dir(model, tokenizer, model_dir)
        write_record(record, model_dir)
        kept = record["kept"]
        log(f"model: trained {record['total_steps']} steps in {record['total_seconds']:.0f} s; kept step "
            f"{kept['step']}: sampled accuracy {kept['sampled']['accuracy']:.1%}, greedy "
            f"{kept['greedy']['accuracy']:.1%} ({'inside' if record['in_target_band'] else 'outside'} the target "
            f"band {sft.target_band})")
        if update_artefact:
            if os.path.isdir(artefact_dir):
                shutil.rmtree(artefact_dir)
            shutil.copytree(model_dir, artefact_dir)
            log(f"model: replaced the committed artefact {artefact_dir}")

    _, tokenizer = load_model_dir(model_dir, with_model=False)
    record = {
        "data_fingerprint": data_fp,
        "model_fingerprint": model_fp,
        "model_source": model_source,
        "train_parquet": train_path,
        "val_parquet": val_path,
        "model_dir": model_dir,
        **_token_lengths(tokenizer, train_path),
    }
    with open(os.path.join(out_dir, BUILD_RECORD), "w") as f:
        json.dump(record, f, indent=2)
    return record


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description="Build the embedded task: parquet data + warm-started model.")
    parser.add_argument("--out", required=True, help="output folder (data/, model/, build.json)")
    parser.add_argument("--setting", choices=sorted(PRESETS), default="default",
                        help="task, model and warm start preset (PRESETS)")
    parser.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN, help="training prompts")
    parser.add_argument("--n-val", type=int, default=DEFAULT_N_VAL, help="validation prompts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parquet problems")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start steps at most (default: the preset's)")
    parser.add_argument("--sft-budget-s", type=float, default=None,
                        help="warm-start wall-clock seconds at most (default: the preset's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the warm start: 1 on a shared machine, 2 on an idle 2-core one")
    parser.add_argument("--force", action="store_true", help="rebuild everything, ignoring caches")
    parser.add_argument("--retrain", action="store_true", help="train the warm start even if the artefact matches")
    parser.add_argument("--update-artefact", action="store_true",
                        help="with --retrain: replace the committed artefact with the new warm start")
    args = parser.parse_args(argv)
    if args.update_artefact and not args.retrain:
        parser.error("--update-artefact needs --retrain: the committed artefact must come from a fresh training run")
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.setting]
    sft = replace(preset.sft, **{key: value for key, value in (("max_steps", args.sft_steps),
                                                               ("budget_s", args.sft_budget_s)) if value is not None})
    record = build(args.out, task=preset.task, model_config=preset.model, sft=sft, n_train=args.n_train,
                   n_val=args.n_val, seed=args.seed, force=args.force, retrain=args.retrain,
                   update_artefact=args.update_artefact, artefact_dir=preset.artefact_dir)
    print(json.dumps({k: record[k] for k in ("model_source", "train_parquet", "val_parquet", "model_dir",
                                             "max_prompt_tokens", "max_reference_response_tokens")}, indent=2))


if __name__ == "__main__":
    main()
