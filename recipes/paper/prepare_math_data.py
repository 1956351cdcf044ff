"""Convert a Hugging Face maths dataset (problem + solution with a \\boxed{} answer) into verl parquet, as verl's own
``examples/data_preprocess`` scripts lay it out: ``train.parquet`` from the dataset's train split and ``test.parquet``
from its official test split (never carved out of the training problems).

    python recipes/paper/prepare_math_data.py --dataset AI-MO/NuminaMath-CoT --out $DATA_DIR/numina
    python recipes/paper/prepare_math_data.py --dataset knoveleng/open-rs --test-dataset HuggingFaceH4/MATH-500 \\
        --out $DATA_DIR/open_rs
    python recipes/paper/prepare_math_data.py --dataset openai/gsm8k --config main --out $DATA_DIR/gsm8k_boxed

A dataset without a test split (open-rs ships only ``train``) needs ``--test-dataset``: the evaluation set to hold out
(MATH-500, the open-rs paper's, has one). Rows without an answer (a boxed one, or GSM8K's ``#### answer``) are dropped
(the reward and the exit probe both need one). The worked solution is kept in ``extra_info.reference_solution`` and
its steps in ``extra_info.reference_steps`` for the reference-continuation value source
(``rredcot_verl/tasks/math_data.py``); verl's own ``gsm8k.py`` keeps GSM8K's in ``extra_info.answer`` instead, which
``task: gsm8k`` reads, and its ``math_dataset.py`` keeps none. Needs network access to the hub (run it on the
cluster, not here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rredcot_verl.tasks.math_data import convert


def official_splits(dataset, name: str, test_dataset=None, test_name: str | None = None, test_split: str = "test"):
    """(train, test) of a ``datasets.DatasetDict``: its ``train`` split, and ``test_split`` of ``test_dataset`` (another
    dataset's, the evaluation set) or else of ``dataset`` itself. Raises ``ValueError`` in one line naming what is
    missing."""
    held_out, held_name = (dataset, name) if test_dataset is None else (test_dataset, test_name or "--test-dataset")
    if "train" not in dataset:
        raise ValueError(f"{name} has no train split (splits: {', '.join(dataset)})")
    if test_split not in held_out:
        hint = "" if test_dataset is not None else "; name an evaluation set with --test-dataset (e.g. HuggingFaceH4/MATH-500)"
        raise ValueError(f"{held_name} has no {test_split} split (splits: {', '.join(held_out)}){hint}")
    return dataset["train"], held_out[test_split]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--config", default=None, help="the dataset's configuration name (gsm8k: main)")
    parser.add_argument("--test-dataset", default=None, help="where the test split comes from (default: --dataset)")
    parser.add_argument("--test-config", default=None, help="--test-dataset's configuration name")
    parser.add_argument("--test-split", default="test", help="the held-out split's name (default: test)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from datasets import load_dataset

    dataset = load_dataset(args.dataset, args.config)
    held_out = load_dataset(args.test_dataset, args.test_config) if args.test_dataset else None
    try:
        train, test = official_splits(dataset, args.dataset, held_out, args.test_dataset, args.test_split)
    except ValueError as error:
        sys.exit(f"prepare_math_data.py: {error}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    convert(train, args.dataset, "train").to_parquet(out / "train.parquet")
    convert(test, args.test_dataset or args.dataset, "test").to_parquet(out / "test.parquet")


if __name__ == "__main__":
    main()
