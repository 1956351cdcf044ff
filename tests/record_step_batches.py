"""Record step batches from short end-to-end runs, for ``tests/test_recorded_step_batches_on_cpu.py``.

    .venv/bin/python tests/record_step_batches.py [CASE ...]     (all cases without arguments; minutes each)

Each case launches ``python -m rredcot_verl.main`` on a recipe of ``recipes/tiny_cpu`` (the embedded task on the
shipped warm start, 4 prompts x 4 samples, 2 steps) with a ``sitecustomize`` on ``PYTHONPATH`` that wraps, in the
trainer's and the actor workers' processes, what the advantage step and the value pass pass each other (nothing of the
package is changed). It keeps per step:
- ``config``: ``algorithm`` as a plain container (``settings_from_config`` rebuilds the settings);
- ``traces``: the fields each stage read from verl's batch (``trainer.step_traces``'s input), for the value stage;
- ``value_pass``: the request the value stage sent (each plan as ``dataclasses.asdict``), the probe scores the actor
  computed (``score_batch_packed_with_stats``'s output, so a replay needs no forward) and the tensors it returned;
- ``advantage``: the step's ``AdvantageBatch`` fields as the trainer built them, and the advantages and returns the
  estimator gave verl.
The fixture of a case is ``tests/fixtures/recorded_step_batches/<case>.pt`` (``torch.save``), with the commit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "recorded_step_batches"
WARM_START = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"
STEPS = 2
# 4 prompts x 4 samples, no validation (tests/test_e2e_on_cpu.py's SMALL); the value gate open, so that the recorded
# advantages are the rule's and not GRPO's fallback on a batch too small for the gate to judge.
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false",
         "trainer.test_freq=-1", "algorithm.rredcot.redistribution.min_value_concordance=0.0"]  # fmt: skip
# case: (recipe, overrides)
CASES = {
    "rredcot_exit_probe": ("rredcot", ["algorithm.rredcot.probe.value_source=exit_probe",
                                       "algorithm.rredcot.redistribution.value_mapping=affine"]),
    "rredcot_reference_continuation": ("rredcot", []),
    "ibpo": ("ibpo", []),
    "rredcot_ibpo": ("rredcot_ibpo", []),
    "segment_mc": ("segment_mc", []),
}

# Loaded by every Python process of the run (Ray workers inherit PYTHONPATH); it wraps the package's functions once
# their modules are imported, and records only where RREDCOT_RECORD_DIR is set.
SITECUSTOMIZE = r'''
import os

if os.environ.get("RREDCOT_RECORD_DIR"):
    import dataclasses
    import functools
    import itertools

    from wrapt import register_post_import_hook

    _FOLDER = os.environ["RREDCOT_RECORD_DIR"]
    _RECORDS = []
    _COUNTER = itertools.count()
    _LAST_INPUTS = {}

    def _save(kind, record):
        import torch

        _RECORDS.append((kind, record))
        torch.save(_RECORDS, os.path.join(_FOLDER, f"records_{os.getpid()}.pt"))

    def _plain(value):
        import numpy as np
        import torch

        if isinstance(value, torch.Tensor):
            if getattr(value, "is_nested", False):
                return {"nested_rows": [row.clone() for row in value.unbind(0)]}
            return value.clone()
        if isinstance(value, np.ndarray):
            return list(value.tolist())
        if isinstance(value, (str, dict)) or dataclasses.is_dataclass(value) or value is None:
            return value
        return list(value)  # a non-tensor field (tensordict's stack of values)

    def _trainer(module):
        original_step_traces = module.step_traces

        def step_traces(data, with_entropy):
            _save("traces", {"fields": {key: _plain(data[key]) for key in data.keys()}, "with_entropy": with_entropy})
            return original_step_traces(data, with_entropy)

        module.step_traces = step_traces
        trainer = module.SegmentCreditTrainer
        original_context = trainer.step_context

        def step_context(self):
            context = original_context(self)
            value_pass = context.value_pass
            step = int(self.global_steps)

            def recorded_value_pass(request):
                output = value_pass(request)
                _save("value_pass", {
                    "step": step,
                    "tensors": {key: request.batch[key].clone() for key in request.batch.keys()},
                    "plans": [dataclasses.asdict(plan) for plan in request.non_tensor_batch["plan"]],
                    "meta_info": dict(request.meta_info),
                    "verified_repairs": context.verified_repairs,
                    "output": {key: output.batch[key].clone() for key in output.batch.keys()},
                })
                return output

            context.value_pass = recorded_value_pass
            return context

        trainer.step_context = step_context
        original_batch = trainer._advantage_batch

        def advantage_batch(self, batch, token_level_rewards, response_mask, uid):
            from omegaconf import OmegaConf

            inputs = original_batch(self, batch, token_level_rewards, response_mask, uid)
            fields = {}
            for field in dataclasses.fields(inputs):
                value = getattr(inputs, field.name)
                fields[field.name] = (dataclasses.asdict(value) if dataclasses.is_dataclass(value)
                                      else _plain(value))
            _LAST_INPUTS.clear()
            _LAST_INPUTS.update({
                "step": int(self.global_steps),
                "estimator": self.estimator,
                "config": OmegaConf.to_container(self.config.algorithm, resolve=True),
                "verl_arguments": {"token_level_rewards": token_level_rewards.clone(),
                                   "response_mask": response_mask.clone(), "index": _plain(uid)},
                "batch": fields,
            })
            return inputs

        trainer._advantage_batch = advantage_batch
        original_advantage_step = module.advantage_step

        def advantage_step(advantage):
            def recorded(token_level_rewards, response_mask, index):
                result = advantage(token_level_rewards, response_mask, index)
                record = dict(_LAST_INPUTS)
                record["result"] = {"advantages": result.advantages.clone(), "returns": result.returns.clone()}
                _save("advantage", record)
                return result

            return original_advantage_step(recorded)

        module.advantage_step = advantage_step

    def _values(module):
        original = module.score_batch_packed_with_stats

        @functools.wraps(original)
        def scored(*args, **kwargs):
            results, stats = original(*args, **kwargs)
            _save("scores", {"call": next(_COUNTER), "results": [dataclasses.asdict(r) for r in results],
                             "stats": dataclasses.asdict(stats)})
            return results, stats

        module.score_batch_packed_with_stats = scored

    register_post_import_hook(_trainer, "rredcot_verl.integration.trainer")
    register_post_import_hook(_values, "rredcot_verl.core.values")
'''


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def record(case: str, work: Path) -> dict:
    """Run ``case`` and gather what its processes recorded."""
    from rredcot_verl.tasks.arithmetic import write_parquet

    recipe, overrides = CASES[case]
    build, out, folder, hooks = work / "build", work / "out", work / "records", work / "hooks"
    for path in (out, folder, hooks):
        path.mkdir(parents=True)
    write_parquet(str(build / "data"), n_train=8, n_val=4, seed=0)
    shutil.copytree(WARM_START, build / "model")
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "RREDCOT_BUILD": str(build), "RREDCOT_STEPS": str(STEPS),
           "RREDCOT_REWARD_FILE": str(ROOT / "rredcot_verl/tasks/reward.py"),
           "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"), "RREDCOT_RECORD_DIR": str(folder),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = ["timeout", "-k", "30", "1200", "setsid", sys.executable, "-m", "rredcot_verl.main",
               "--config-dir", str(ROOT / "recipes" / "tiny_cpu"), "--config-name", recipe,
               f"algorithm.rredcot.snapshot_dir={out / 'snapshots'}", *SMALL, *overrides]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    (out / "stdout.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        log = (result.stdout + result.stderr)[-4000:]
        raise RuntimeError(f"{case}: the run failed (exit {result.returncode}):\n{log}")
    recorded: dict[str, list] = {"traces": [], "value_pass": [], "scores": [], "advantage": []}
    for path in sorted(folder.glob("records_*.pt")):
        for kind, entry in torch.load(path, weights_only=False):
            recorded[kind].append(entry)
    recorded["scores"].sort(key=lambda entry: entry["call"])  # one actor rank: one process counts them
    steps = []
    for step, advantage in enumerate(recorded["advantage"], start=1):
        if advantage.get("step") != step:
            order = [entry.get("step") for entry in recorded["advantage"]]
            raise RuntimeError(f"{case}: advantage records out of order: {order}")
        steps.append({"advantage": advantage})
    # One value pass a step (one actor rank: one scoring call each), and the value stage's traces (read with the
    # log-prob pass's entropies) one a step.
    value_traces = [entry for entry in recorded["traces"] if entry["with_entropy"]]
    for i, value_pass in enumerate(recorded["value_pass"]):
        steps[value_pass["step"] - 1]["value_pass"] = {**value_pass, "scores": recorded["scores"][i]}
        steps[value_pass["step"] - 1]["traces"] = value_traces[i]
    return {"case": case, "recipe": recipe, "overrides": [*SMALL, *overrides], "commit": _commit(), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"of {list(CASES)}; all without arguments")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    unknown = [case for case in args.cases if case not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for case in args.cases or list(CASES):
        with tempfile.TemporaryDirectory(prefix=f"record_{case}_") as work:
            recorded = record(case, Path(work))
            torch.save(recorded, args.out / f"{case}.pt")
            print(f"{case}: {len(recorded['steps'])} steps -> {args.out / f'{case}.pt'} "
                  f"({(args.out / f'{case}.pt').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
