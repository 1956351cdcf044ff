"""Convert a Hugging Face maths dataset (problem + solution with a \\boxed{} answer) into verl parquet.

    python recipes/paper/prepare_math_data.py --dataset AI-MO/NuminaMath-CoT --out $DATA_DIR/numina
    python recipes/paper/prepare_math_data.py --dataset knoveleng/open-rs --out $DATA_DIR/open_rs

Rows whose solution has no boxed answer are dropped (the reward and the exit probe both need one). The reference
solution is kept in ``extra_info.reference_solution`` for the reference-continuation value source.
Needs network access to the hub (run it on the cluster, not here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from rredcot_verl.tasks.reward import extract_boxed_answer

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def convert(rows, source: str, split: str) -> pd.DataFrame:
    records = []
    for index, row in enumerate(rows):
        problem = row.get("problem") or row.get("question")
        solution = row.get("solution") or ""
        answer = row.get("answer") or extract_boxed_answer(solution)
        if not problem or not answer:
            continue
        records.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "reference_solution": solution},
            }
        )
    return pd.DataFrame(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--val-size", type=int, default=500)
    args = parser.parse_args()
    from datasets import load_dataset

    data = load_dataset(args.dataset, split="train").shuffle(seed=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    convert(data.select(range(args.val_size)), args.dataset, "val").to_parquet(out / "val.parquet")
    convert(data.select(range(args.val_size, len(data))), args.dataset, "train").to_parquet(out / "train.parquet")


if __name__ == "__main__":
    main()
