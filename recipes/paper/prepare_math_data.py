"""Convert a Hugging Face maths dataset (problem + solution with a \\boxed{} answer) into verl parquet.

    python recipes/paper/prepare_math_data.py --dataset AI-MO/NuminaMath-CoT --out $DATA_DIR/numina
    python recipes/paper/prepare_math_data.py --dataset knoveleng/open-rs --out $DATA_DIR/open_rs
    python recipes/paper/prepare_math_data.py --dataset openai/gsm8k --config main --out $DATA_DIR/gsm8k

Rows without an answer (a boxed one, or GSM8K's ``#### answer``) are dropped (the reward and the exit probe both need
one). The reference solution is kept in ``extra_info.reference_solution`` and its steps in
``extra_info.reference_steps`` for the reference-continuation value source (``rredcot_verl/tasks/math_data.py``).
Needs network access to the hub (run it on the cluster, not here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rredcot_verl.tasks.math_data import convert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--config", default=None, help="the dataset's configuration name (gsm8k: main)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--val-size", type=int, default=500)
    args = parser.parse_args()
    from datasets import load_dataset

    data = load_dataset(args.dataset, args.config, split="train").shuffle(seed=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    convert(data.select(range(args.val_size)), args.dataset, "val").to_parquet(out / "val.parquet")
    convert(data.select(range(args.val_size, len(data))), args.dataset, "train").to_parquet(out / "train.parquet")


if __name__ == "__main__":
    main()
