"""The embedded default task: chained arithmetic, a tiny from-scratch Qwen2 and its supervised warm start.

``python -m rredcot_verl.tasks.build --out DIR`` writes verl-format parquet data and a model folder; the reward
function for verl is ``rredcot_verl/tasks/reward.py::compute_score``.
"""

from rredcot_verl.tasks.arithmetic import (
    DATA_SOURCE,
    ArithmeticProblem,
    ArithmeticTaskConfig,
    first_wrong_step,
    make_problem,
    parse_prompt,
    reference_response,
    reference_steps,
    write_parquet,
)
from rredcot_verl.tasks.base import TASKS, Task, resolve_task
from rredcot_verl.tasks.model import TinyModelConfig, build_model, build_tokenizer, load_model_dir, save_model_dir
from rredcot_verl.tasks.reward import compute_score, extract_boxed_answer

__all__ = [
    "DATA_SOURCE",
    "ArithmeticProblem",
    "ArithmeticTaskConfig",
    "TASKS",
    "Task",
    "TinyModelConfig",
    "build_model",
    "build_tokenizer",
    "compute_score",
    "extract_boxed_answer",
    "first_wrong_step",
    "load_model_dir",
    "make_problem",
    "parse_prompt",
    "reference_response",
    "reference_steps",
    "resolve_task",
    "save_model_dir",
    "write_parquet",
]
