"""How far the trainer's call walks through the package to the advantage tensor, on a recorded step batch.

    .venv/bin/python tests/count_advantage_path.py [CASE] [--list]     (default case: rredcot_exit_probe)

Replays step 1 of ``tests/fixtures/recorded_step_batches/<CASE>.pt`` through the trainer, in two parts, under a
``sys.setprofile`` tracer that keeps the calls of functions defined in ``rredcot_verl/`` (comprehensions and generator
expressions left out, lambdas kept; dataclass-generated methods are not in a file of the package):
- inputs: ``SegmentCreditTrainer._produce`` of the value stage, from reading verl's batch to writing the stage's
  inputs, the actor's ``value_pass`` run in this process on the warm start (the worker's method on a stand-in engine);
- advantage: ``SegmentCreditTrainer._compute_advantage``, with verl's own body (the superclass's) replaced by its call
  of the registered estimator on the recorded arguments.
Per part it prints the distinct functions called, the files they are in, the calls made, the deepest nesting of
the package's frames (``--list``: the functions too), and the walk to each piece of the method's work that the part
reaches (segmenting a trace, building its probes, scoring them, reading values off the probes' log-probs, the credit
rule): the package's calls from the part's entry down to where that work is done, the fewest over its calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import copy
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "rredcot_verl")
sys.path.insert(0, str(ROOT / "tests"))

COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")
# Where the method's work is done. The credit rule: token_advantages since issue 64's rewrite, the anchored
# redistribution inside redistribute before it (so that the walk counts the same at either commit).
WORK = ("segment_response", "build_exit_probes", "score_batch_packed_with_stats", "values_from_probe_logp",
        "token_advantages", "_anchored_redistribution")


class Tracer:
    def __init__(self):
        self.calls: Counter = Counter()
        self.depth = 0
        self.deepest: list[str] = []
        self.walks: dict[str, list[str]] = {}

    def __call__(self, frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        name = frame.f_code.co_qualname
        if name.rsplit(".", 1)[-1] in COMPREHENSIONS:
            return
        self.calls[(frame.f_code.co_filename[len(PACKAGE) - len("rredcot_verl"):], name)] += 1
        stack, current = [], frame
        while current is not None:
            code = current.f_code
            if code.co_filename.startswith(PACKAGE) and code.co_qualname.rsplit(".", 1)[-1] not in COMPREHENSIONS:
                stack.append(f"{Path(code.co_filename).name}:{code.co_qualname}")
            current = current.f_back
        if len(stack) > self.depth:
            self.depth, self.deepest = len(stack), stack[::-1]
        if name in WORK and (name not in self.walks or len(stack) < len(self.walks[name])):
            self.walks[name] = stack[::-1]

    def report(self, part: str, listing: bool) -> None:
        files = {file for file, _ in self.calls}
        print(f"{part}: {len(self.calls)} functions in {len(files)} files, {sum(self.calls.values())} calls, "
              f"deepest nesting {self.depth}")
        for name, walk in self.walks.items():
            print(f"    walk to {name}: {len(walk) - 1} calls, {len({frame.split(':')[0] for frame in walk})} files"
                  + (" (" + " > ".join(walk) + ")" if listing else ""))
        if listing:
            print("    deepest: " + " > ".join(self.deepest))
            for (file, name), count in sorted(self.calls.items()):
                print(f"    {file}:{name} x{count}")


@contextlib.contextmanager
def traced(tracer: Tracer):
    sys.setprofile(tracer)
    try:
        yield
    finally:
        sys.setprofile(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", default="rredcot_exit_probe")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    import conftest
    from rredcot_verl.core.concordance import ConcordanceCounts
    from rredcot_verl.core.settings import settings_from_config
    from rredcot_verl.integration.estimators import AdvantageBatch
    from rredcot_verl.integration.trainer import TRAINER_NAME, SegmentCreditTrainer
    from rredcot_verl.integration.workers import SegmentActorRolloutRefWorker
    from test_recorded_step_batches_on_cpu import FIXTURES, _field

    recorded = torch.load(FIXTURES / f"{args.case}.pt", weights_only=False)
    step = recorded["steps"][0]
    advantage = step["advantage"]
    # The keys conftest's make_trainer pins (the launcher would resolve their `auto`); the recorded settings follow.
    overrides = (f"trainer.v1.trainer_mode={TRAINER_NAME}", f"actor_rollout_ref.model.path={conftest.WARM_START}",
                 "algorithm.rredcot.task=arithmetic", "algorithm.rredcot.probe.profile=embedded",
                 "algorithm.rredcot.probe.value_source=exit_probe", "algorithm.rredcot.candidates.source=both",
                 f"algorithm.adv_estimator={advantage['estimator']}")  # fmt: skip
    trainer = SegmentCreditTrainer(copy.deepcopy(conftest._trainer_config(overrides)))
    trainer._init_tokenizer()
    trainer.global_steps, trainer.timing_raw = advantage["step"], {}
    settings = settings_from_config(OmegaConf.create(advantage["config"]))
    trainer.settings = dataclasses.replace(settings, snapshot_dir=None)
    trainer.stages = trainer.spec.stages(trainer.settings)
    store = {key: _field(value) for key, value in step.get("traces", {"fields": {}})["fields"].items()}
    trainer._fetch = lambda batch, fields: {key: store[key] for key in fields if key in store}
    trainer._put = lambda batch, tensors: store.update(tensors) or batch

    if "value_pass" in step:
        model = AutoModelForCausalLM.from_pretrained(str(conftest.WARM_START), torch_dtype=torch.float32)
        engine = SimpleNamespace(eval_mode=contextlib.nullcontext, module=model)
        worker = SimpleNamespace(actor=SimpleNamespace(engine=engine))
        trainer.actor_rollout_wg = SimpleNamespace(
            value_pass=lambda request: SegmentActorRolloutRefWorker.value_pass(worker, request))
        value_stage = trainer.stages[-1]
        trainer.stages = (value_stage,)  # a repair stage before it generates; its recorded repairs stand in
        context = trainer.step_context()
        context.verified_repairs = step["value_pass"]["verified_repairs"]
        tracer = Tracer()
        with traced(tracer):
            trainer._produce(value_stage, context, None, {}, with_entropy=True)
        tracer.report("inputs", args.list)

    batch = advantage["batch"]
    store["uid"] = list(batch["index"])
    for name in trainer.spec.inputs:
        store[AdvantageBatch.BATCH_KEYS[name]] = batch[name]
    prior = ConcordanceCounts(**batch["prior_concordance"])
    trainer.value_window.pooled = lambda: prior
    arguments = advantage["verl_arguments"]

    def verls_compute_advantage(self, batch, metrics):
        ADV_ESTIMATOR_REGISTRY[advantage["estimator"]](arguments["token_level_rewards"], arguments["response_mask"],
                                                       index=np.array(arguments["index"], dtype=object))  # fmt: skip
        return batch

    PPOTrainerSync._compute_advantage = verls_compute_advantage
    tracer = Tracer()
    with traced(tracer):
        trainer._compute_advantage(None, {})
    tracer.report("advantage", args.list)


if __name__ == "__main__":
    main()
