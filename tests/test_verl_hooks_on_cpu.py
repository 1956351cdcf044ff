"""The canary for a verl upgrade: every verl name of ``integration/verl_hooks.VERL_HOOKS`` still exists in the
installed verl with the signature and, where recorded, the source the package was written against (verl 0.9.1); and
the table lists every method of verl's trainer that the rredcot trainer overrides. docs/usage.md, "Upgrading verl"."""

import inspect

import pytest
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

import rredcot_verl.integration.plugin  # noqa: F401  (as in verl's processes: the entry-point guard wraps its function)
from rredcot_verl.compat.cpu import enable_cpu_mode
from rredcot_verl.integration.trainer import SegmentCreditTrainer
from rredcot_verl.integration.verl_hooks import OVERRIDE, VERL_HOOKS, normalised_hash, observed, resolve

TABLE = "rredcot_verl/integration/verl_hooks.py"


# verl's vLLM modules import vllm (not installed beside verl's pinned transformers) and pass its version gate in CPU
# mode
VLLM_MODULES = "verl.workers.rollout.vllm_rollout."


def _params(hooks):
    return [pytest.param(hook, marks=pytest.mark.vllm if hook.name.startswith(VLLM_MODULES) else (),
                         id=hook.name.split(":")[1]) for hook in hooks]


@pytest.mark.parametrize("hook", _params(VERL_HOOKS))
def test_verl_still_has_what_the_package_relies_on(hook):
    if hook.name.startswith(VLLM_MODULES):
        enable_cpu_mode()
    advice = (f"the package uses it because {hook.why}; re-check that {hook.relies_on}, adapt the use if not, then "
              f"record what this verl has in {TABLE} (python -m rredcot_verl.integration.verl_hooks prints it)")
    try:
        resolve(hook.name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{hook.name} is gone from the installed verl ({error}): {advice}")
    signature, digest = observed(hook)
    assert signature == hook.signature, (f"{hook.name} has the signature {signature}, not {hook.signature} as in verl "
                                         f"0.9.1: {advice}")  # fmt: skip
    assert digest == hook.source_sha256, f"{hook.name}'s source changed since verl 0.9.1: {advice}"


def _trainer_methods_verl_defines() -> set[str]:
    """The methods (and properties) the rredcot trainer defines that verl's sync trainer also has."""
    return {name for name, member in vars(SegmentCreditTrainer).items()
            if (inspect.isfunction(member) or hasattr(member, "__get__")) and not name.startswith("__")
            and hasattr(PPOTrainerSync, name)} | {"__init__"}  # fmt: skip


def test_every_override_of_verls_trainer_is_listed():
    listed = {hook.name.split(".")[-1]: hook for hook in VERL_HOOKS if hook.kind == OVERRIDE}
    overridden = _trainer_methods_verl_defines()
    assert overridden == set(listed), (f"overrides of verl's trainer not in {TABLE}: "
                                       f"{sorted(overridden - set(listed))}; listed but not overridden: "
                                       f"{sorted(set(listed) - overridden)}")  # fmt: skip
    for name, hook in listed.items():  # the entry names the method the override replaces, on the class verl runs
        assert resolve(hook.name) is inspect.unwrap(getattr(PPOTrainerSync, name)), hook.name


def test_the_source_hash_sees_code_and_ignores_comments_and_blank_lines():
    recorded = "    def step(batch):\n        # why\n        return batch + 1\n"
    assert normalised_hash(recorded) == normalised_hash("def step(batch):\n\n    return batch + 1  # another why\n")
    assert normalised_hash(recorded) != normalised_hash("def step(batch):\n    return batch + 2\n")
