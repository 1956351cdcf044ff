"""``python -m rredcot_verl.main``: verl's PPO entry point with the rredcot estimators, trainer and CPU support.

Config: verl's ``ppo_trainer`` composed with ``conf/rredcot_trainer.yaml`` (hydra), so every verl key works as usual;
``algorithm.adv_estimator`` may be ``grpo`` or any verl estimator, or ``rredcot`` / ``ibpo`` / ``rredcot_ibpo`` /
``segment_mc``, whose settings live under ``algorithm.rredcot``. Every estimator trains with the rredcot trainer, verl's
sync trainer plus the estimators' hooks. Before Ray starts, the launcher checks what would otherwise fail late or
degrade silently. For every estimator: an environment variable the config reads that is not set, one of verl's async
trainer modes, an unknown estimator, a missing or broken local model folder (hub ids are verl's to download), local
dataset files that do not exist or that verl cannot read (``dataset_files``). For this package's estimators also:
unknown ``algorithm.rredcot`` keys, datasets without ``reward_model.ground_truth`` or whose prompts all exceed
``data.max_prompt_length``, reference continuations of worked solutions the training rows do not have, extra generations
without a rule reward to judge them, an engine context too short for IBPO's revisions, Ulysses sequence parallelism, and
the run shapes of ``run_shapes.py`` (legacy trainer, bypass mode, a critic, groups of one, multi-turn rollouts, KL in
reward, DAPO's overlong penalty, a reward model, Megatron, a model the value pass cannot score exactly). The
``algorithm.rredcot`` keys left at ``auto`` are chosen there from the training rows (``choose_auto_settings``) and
written into the config, in one line saying which and why. Where verl scores the rows with its own scorer, the scale of
that scorer becomes ``algorithm.rredcot.reward_range`` unless the recipe set one (``adopt_scorer_reward_range``).

``python -m rredcot_verl.main --check-only ...`` runs every check, prints ``ok`` (naming the checks it had to skip: a
hub model or tokenizer not in the local cache, remote dataset files) or the refusal, and exits 0 / 2 without starting
Ray or loading weights. On a machine without an accelerator the launcher switches on ``rredcot_verl.compat`` and the
matching config (``RREDCOT_CPU=0`` forces it off; ``RREDCOT_CPU=1`` forces it on).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from rredcot_verl.compat.cpu import CPU_ENV, CPU_PROCESS_ENV, accelerator_present, enable_cpu_mode, vllm_thread_binding
from rredcot_verl.core.settings import AUTO, AUTO_KEYS, DataOffer, resolve_auto, settings_from_config
from rredcot_verl.integration import dataset_files

# Config for a CPU-only run of verl 0.9.1 (docs/cpu.md): fake Ray GPU for verl's resource pools, enough
# logical CPUs for TransferQueue's actors (under-declaring hangs silently), FSDP2 over gloo, sdpa attention, no vLLM
# sleep mode (unsupported on CPU).
CPU_CONFIG = {
    "trainer.device": "cpu",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.actor.use_torch_compile": False,
    "actor_rollout_ref.rollout.enable_sleep_mode": False,
    "actor_rollout_ref.rollout.free_cache_engine": False,
    "actor_rollout_ref.rollout.enforce_eager": True,
}


# Resources a local CPU cluster declares: verl's resource pools ask for one (fake) GPU per actor rank, and
# TransferQueue starts ~10 one-CPU actors. A cluster started by hand needs the same (`ray start --head --num-cpus=32
# --num-gpus=<trainer.n_gpus_per_node>`).
LOCAL_CPU_CLUSTER_CPUS = 32


def local_cpu_cluster(config: DictConfig) -> dict:
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    # No dashboard: its processes cost a small CPU run ~10 CPU-s and nothing reads them (a cluster started with
    # `ray start` keeps its own).
    return {"ray_kwargs.ray_init.num_cpus": LOCAL_CPU_CLUSTER_CPUS, "ray_kwargs.ray_init.num_gpus": gpus,
            "ray_kwargs.ray_init.include_dashboard": False}


# Variables of the launching shell that every Ray process must see (local workers inherit them; a remote cluster
# gets them through runtime_env).
FORWARDED_ENV = ("VERL_FILE_LOGGER_PATH", "RREDCOT_BUILD", "RREDCOT_REWARD_FILE", "RREDCOT_SEED", "RREDCOT_STEPS")


# The verl.plugins entry point; named again for Ray workers on clusters that do not read entry points.
PLUGIN_MODULE = "rredcot_verl.integration.plugin"


class LaunchError(RuntimeError):
    """A configuration problem found before Ray starts; printed without a traceback."""


def _set(config: DictConfig, dotted: str, value) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    with open_dict(config):
        for key in parents:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[leaf] = value


def use_cpu_mode() -> bool:
    forced = os.environ.get(CPU_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return not accelerator_present()


# A Hugging Face hub id ("Qwen/Qwen3-4B"), which verl downloads itself (workers/config/model.py: copy_to_local).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_remote_model(path: str) -> bool:
    """A hub id or a ``scheme://`` location (hdfs://...) that verl fetches, rather than a local folder."""
    return "://" in path or (_HUB_ID.match(path) is not None and not Path(path).exists())


def check_model_dir(path: str) -> None:
    """A local model folder must hold a config, a tokenizer and weights; hub ids and remote paths are verl's to fetch."""
    if is_remote_model(path):
        return
    folder = Path(path)
    if not folder.is_dir():
        raise LaunchError(
            f"model folder {path!r} does not exist (actor_rollout_ref.model.path); give a local folder or a hub id "
            "such as Qwen/Qwen3-4B"
        )
    missing = [name for name in ("config.json", "tokenizer_config.json") if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        missing.append("*.safetensors weights")
    if missing:
        raise LaunchError(f"model folder {path!r} is broken: missing {', '.join(missing)}")


def is_remote_uri(path: str) -> bool:
    """A ``scheme://`` location (hdfs://, s3://, gs://) that verl copies to local disk itself."""
    return "://" in str(path)


def check_dataset(path, key: str, need_ground_truth: bool, skipped: list[str]) -> None:
    """Local files must exist; for this package's estimators every row needs ``reward_model.ground_truth`` (its
    extra generations and outcomes are judged by the rule reward). Remote URIs are verl's to fetch: skipped."""
    files = [path] if isinstance(path, str) else list(path)
    for file in files:
        if is_remote_uri(file):
            skipped.append(f"{key} {file!r} (remote: verl copies it at start)")
            continue
        if not Path(file).is_file():
            raise LaunchError(f"{key} file {file!r} does not exist")
        refusal = dataset_files.format_refusal(file, key)
        if refusal:
            raise LaunchError(refusal)
        if not need_ground_truth:
            continue
        if "reward_model" not in dataset_files.column_names(file):
            raise LaunchError(f"{key} file {file!r} has no reward_model column (need reward_model.ground_truth)")
        rows = dataset_files.read_column(file, "reward_model")
        bad = sum(1 for row in rows if not isinstance(row, dict) or row.get("ground_truth") is None)
        if bad:
            raise LaunchError(f"{key} file {file!r}: {bad} of {len(rows)} rows lack reward_model.ground_truth")


def check_task_answers(config: DictConfig, settings, skipped: list[str], sample: int = 64) -> None:
    """Refuse a task that reads no answer from a sample of the training rows (``tasks.check_dataset_rows``: e.g.
    ``boxed_math`` on verl's GSM8K rows, whose answers follow ``####``): every probe would score nothing."""
    from rredcot_verl.tasks.base import check_dataset_rows

    if settings.task == "code":  # its ground truths are tests, which the sandbox reads, not an answer text
        return
    files = config.data.train_files
    first = files if isinstance(files, str) else list(files)[0]
    if is_remote_uri(first):
        skipped.append(f"algorithm.rredcot.task={settings.task} against {first!r} (remote)")
        return
    prompt_key = config.data.get("prompt_key", "prompt")
    rows = dataset_files.first_rows(first, (prompt_key, "reward_model", "extra_info"), sample)
    problem = check_dataset_rows(settings.task, [{**row, "prompt": row.get(prompt_key)} for row in rows])
    if problem:
        raise LaunchError(problem)


def training_sample(config: DictConfig, columns: tuple[str, ...], sample: int = 64) -> list[dict] | None:
    """The first ``sample`` rows of the first training file (the ``columns`` it has), as dicts; None when the file is
    remote (verl copies it at start)."""
    files = config.data.train_files
    first = files if isinstance(files, str) else list(files)[0]
    if is_remote_uri(first):
        return None
    return dataset_files.first_rows(first, columns, sample)


def worked_solutions(config: DictConfig, task: str) -> tuple[int, int] | None:
    """How many of the sampled training rows carry a worked solution the reference continuation reads
    (``tasks.base.worked_solution``), and how many were sampled; None when the training file is remote."""
    from rredcot_verl.tasks.base import worked_solution

    rows = training_sample(config, ("extra_info",))
    if rows is None:
        return None
    try:
        return sum(worked_solution(task, row.get("extra_info")) is not None for row in rows), len(rows)
    except ValueError as error:  # a module:attr task that cannot be loaded
        raise LaunchError(str(error)) from error


def choose_auto_settings(config: DictConfig, spec, skipped: list[str]) -> None:
    """Choose the ``algorithm.rredcot`` keys left at ``auto`` (``core.settings.AUTO_RULES``) from the training rows
    and the run shape, write them into the config (the trainer's processes read them from it) and name them, and
    why, in one line."""
    from rredcot_verl.integration.run_shapes import multi_turn_key

    section = config.algorithm.get("rredcot", None)
    if section is None:
        return
    plain = OmegaConf.to_container(section, resolve=True)
    if not any((plain.get(key.split(".")[0]) or {}).get(key.split(".")[1]) == AUTO for key in AUTO_KEYS):
        return
    estimator = str(config.algorithm.adv_estimator)
    offer = None
    if spec is not None:
        counted = worked_solutions(config, str(plain.get("task", "boxed_math")))
        if counted is None:
            skipped.append("worked solutions in data.train_files (remote): algorithm.rredcot auto keys chosen as "
                           "for data without them")
        offer = DataOffer(worked_solutions=None if counted is None else counted[0] > 0,
                          multi_turn=multi_turn_key(config) is not None)
    try:
        _, choice = resolve_auto(plain, estimator, offer)
    except ValueError as error:
        raise LaunchError(str(error)) from error
    for key, value in choice.values.items():
        _set(config, f"algorithm.rredcot.{key}", value)
    if choice.reason:
        chosen = " ".join(f"algorithm.rredcot.{key}={value}" for key, value in choice.values.items())
        print(f"rredcot_verl: algorithm.adv_estimator={estimator}: {chosen} (auto): {choice.reason}; set a key to "
              "choose otherwise")


def check_worked_solutions(config: DictConfig, settings, spec) -> None:
    """Refuse reference-continuation values whose bank reads the dataset's worked solutions (``candidates.source``
    ``ground_truth`` or ``both``) when none of the sampled training rows has one: the bank would hold the ground-truth
    answer alone (``ground_truth``: no value at all) or only the group's traces (``both``), without a word."""
    if spec is None or not spec.uses_value_pass:
        return
    if settings.probe.value_source != "reference_continuation" or not settings.candidates.uses_dataset:
        return
    counted = worked_solutions(config, settings.task)
    if counted is None or counted[0] > 0:
        return
    source = settings.candidates.source
    instead = "group_and_repairs (README row C)" if source == "ground_truth" else "group or group_and_repairs"
    raise LaunchError(
        f"algorithm.rredcot.candidates.source={source} continues the dataset's worked solutions, and none of the "
        f"{counted[1]} sampled rows of data.train_files has one (extra_info.reference_steps, or what "
        f"algorithm.rredcot.task={settings.task} reads as one): set algorithm.rredcot.candidates.source={instead}, or "
        "write the solutions (recipes/paper/prepare_math_data.py)"
    )


def _local_pretrained(loader, path: str):
    """``loader.from_pretrained`` on a local folder or a hub id already in the local cache; None otherwise (the
    checks that need it are skipped rather than download at launch)."""
    try:
        return loader.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def sampled_prompt_lengths(config: DictConfig, tokenizer, sample: int = 64) -> list[int]:
    """Token counts of the first ``sample`` training prompts with the chat template, as verl renders them; empty
    where the tokenizer or the file is not on this machine."""
    files = config.data.train_files
    first = files if isinstance(files, str) else list(files)[0]
    if tokenizer is None or is_remote_uri(first):
        return []
    key = config.data.get("prompt_key", "prompt")
    prompts = [row[key] for row in dataset_files.first_rows(first, (key,), sample) if key in row]
    kwargs = dict(config.data.get("apply_chat_template_kwargs", None) or {})
    return [
        len(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs))
        for p in prompts
    ]


def check_prompt_lengths(config: DictConfig, lengths: list[int]) -> None:
    """Refuse a training set whose sampled prompts (``lengths``: ``sampled_prompt_lengths``) all exceed
    ``data.max_prompt_length`` with the chat template: verl would filter every row out and fail later with
    ``num_samples=0``."""
    if not config.data.get("filter_overlong_prompts", True):
        return
    files = config.data.train_files
    first = files if isinstance(files, str) else list(files)[0]
    limit = int(config.data.max_prompt_length)
    if lengths and min(lengths) > limit:
        raise LaunchError(
            f"every sampled prompt of {first!r} is longer than data.max_prompt_length={limit} tokens with the chat "
            f"template (shortest {min(lengths)}): verl would filter out the whole dataset; raise data.max_prompt_length"
        )


def _stages(config: DictConfig, settings) -> tuple:
    from rredcot_verl.integration.estimators import ESTIMATORS

    spec = ESTIMATORS.get(str(config.algorithm.adv_estimator))
    return () if spec is None else spec.stages(settings)


def check_rule_reward(config: DictConfig, settings) -> None:
    """Refuse an estimator that judges extra generations (repairs, continuations) without a rule reward to judge them
    with, or with a reward manager that scores rollouts otherwise than that function (it would fail at the first
    step, or judge repairs and rollouts differently)."""
    from rredcot_verl.integration.estimators import generates
    from rredcot_verl.integration.rollouts import reward_manager_refusal

    if not generates(_stages(config, settings)):
        return
    custom = config.reward.get("custom_reward_function", None) or {}
    if not custom.get("path"):
        raise LaunchError(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator} (candidates.source={settings.candidates.source})"
            " judges its extra generations with the rule reward: set reward.custom_reward_function.path (and .name)"
        )
    refusal = reward_manager_refusal(config)
    if refusal:
        raise LaunchError(refusal)


def check_ibpo_context(config: DictConfig, settings, hf_config, prompt_lengths: list[int]) -> None:
    """Refuse an engine context in which IBPO could not repair a failure of the full response budget with its
    ``repair_operator`` (``core.ibpo.engine_context_need``). A resumed repair is its rollout's prompt and at most
    ``data.max_response_length`` tokens: it needs exactly what the longest rollout does, read from the longest sampled
    prompt (``prompt_lengths``; ``data.max_prompt_length`` where the tokenizer is not local). A rewrite's prompt holds
    the question, the trace and a reference, and the rewrite may be ``revision_budget`` tokens. The advice lists only
    the changes the model's positions allow, the smallest first."""
    from rredcot_verl.core.ibpo import engine_context_need, largest_response_length
    from rredcot_verl.integration.estimators.ibpo import REPAIR_STAGE

    if REPAIR_STAGE not in _stages(config, settings):
        return
    positions = None
    if hf_config is not None:
        from verl.workers.rollout.utils import get_max_position_embeddings

        positions = get_max_position_embeddings(hf_config)
    context = config.actor_rollout_ref.rollout.get("max_model_len", None) or positions
    if context is None:
        return
    context, cfg = int(context), settings.ibpo
    limit, response = int(config.data.max_prompt_length), int(config.data.max_response_length)
    prompt = min(max(prompt_lengths), limit) if prompt_lengths else limit
    need = engine_context_need(prompt, response, cfg)
    if context >= need:
        return
    estimator, reach = str(config.algorithm.adv_estimator), positions or context
    prompt_named = (f"the longest sampled prompt ({prompt} tokens with the chat template)" if prompt_lengths else
                    f"data.max_prompt_length {prompt}")  # fmt: skip
    fixes = []
    beyond_engine = f" (with max_model_len {reach})" if reach > context else ""
    fitting = largest_response_length(prompt, reach, cfg)
    if cfg.repair_operator == "rewrite":
        # The revision template is the rewrite's prompt, which resume refuses (IBPOSettings): the switch unsets it.
        resumed = dataclasses.replace(cfg, repair_operator="resume", revision_template=None)
        switch = "algorithm.rredcot.ibpo.repair_operator=resume" + (
            " algorithm.rredcot.ibpo.revision_template=null" if cfg.revision_template is not None else "")
        resume = engine_context_need(prompt, response, resumed)
        resumed_fitting = largest_response_length(prompt, reach, resumed)
        if resume <= min(context, reach):
            fixes.append(f"{switch} (it needs {resume}, which the engine has)")
        elif resume <= reach:
            fixes.append(f"{switch} with actor_rollout_ref.rollout.max_model_len >= {resume}")
        elif resumed_fitting > fitting:  # resumed, a repair takes a third of a rewrite's context: a longer response
            fixes.append(f"{switch} with data.max_response_length <= {resumed_fitting}{beyond_engine}")
    if need <= reach:
        fixes.append(f"actor_rollout_ref.rollout.max_model_len >= {need}")
    if fitting >= 1:
        fixes.append(f"data.max_response_length <= {fitting}{beyond_engine}")
    if cfg.repair_operator == "rewrite" and response:
        factor = (reach - prompt - 2 * response - cfg.revision_slack_tokens) / response
        if factor >= 1:
            fixes.append(f"algorithm.rredcot.ibpo.revision_length_factor <= {math.floor(factor * 100) / 100}")
    if not fixes:
        fixes.append("a shorter data.max_prompt_length")
    within = f"; the model has {positions} positions" if positions else ""
    if cfg.repair_operator == "resume":
        what = (f"resuming a failure needs its rollout's own context, {prompt_named} + data.max_response_length "
                f"{response} = {need} tokens")  # fmt: skip
    else:
        what = (f"revising a {response}-token failure needs at least {need} tokens of engine context (question "
                f"{prompt} + trace and reference 2 x {response} + repair {need - prompt - 2 * response})")
    raise LaunchError(
        f"algorithm.adv_estimator={estimator} generates IBPO repairs (algorithm.rredcot.ibpo.repair_operator="
        f"{cfg.repair_operator}): {what}, the engine has {context}{within}: set {', or '.join(fixes)}"
    )


def adopt_scorer_reward_range(config: DictConfig) -> str | None:
    """Set ``algorithm.rredcot.reward_range`` to the scale of verl's own scorer for the training rows
    (``reward_scale.scorer_reward_range``: ``math_dapo`` scores -1 / +1) where the recipe left the default; returns
    the launch line saying so, or None. A range set otherwise that disagrees with the scorer is refused, as are rows
    whose scorers disagree with each other."""
    from rredcot_verl.core.settings import RRedCoTSettings
    from rredcot_verl.integration.reward_scale import scorer_reward_range

    try:
        found = scorer_reward_range(config)
    except ValueError as error:
        raise LaunchError(str(error)) from error
    if found is None:
        return None
    scale, scorer = found
    configured = settings_from_config(config.algorithm).reward_range
    if configured == scale:
        return None
    shown = f"[{scale[0]:g}, {scale[1]:g}]"
    if configured != RRedCoTSettings().reward_range:
        raise LaunchError(
            f"algorithm.rredcot.reward_range=[{configured[0]:g}, {configured[1]:g}] is not the scale of {scorer}, "
            f"{shown}: set algorithm.rredcot.reward_range={shown}, or leave it out"
        )
    _set(config, "algorithm.rredcot.reward_range", list(scale))
    return f"algorithm.rredcot.reward_range={shown}: the scale of {scorer}"


def check_estimator(name: str) -> None:
    import rredcot_verl.integration.plugin  # noqa: F401  (registers ours)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    if name not in ADV_ESTIMATOR_REGISTRY:
        raise LaunchError(f"unknown algorithm.adv_estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")


def check_value_pass_parallelism(config: DictConfig, estimator: str) -> None:
    """Refuse Ulysses sequence parallelism with an estimator whose inputs are computed on whole traces
    (``EstimatorSpec.whole_traces_per_rank``: the value pass feeds each rank whole traces plus probe tokens with a
    probe mask), while Ulysses ranks each hold a slice of one sequence."""
    from rredcot_verl.integration.estimators import ESTIMATORS

    size = int(config.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
    spec = ESTIMATORS.get(estimator)
    if spec is not None and spec.whole_traces_per_rank and size > 1:
        why = ("the segment value pass scores whole traces per rank" if spec.uses_value_pass else
               "its segment boundaries are cut on whole traces from the entropies of verl's log-prob pass, which has "
               "not been run under Ulysses' sequence slices with it")  # fmt: skip
        raise LaunchError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size} is not supported with "
            f"algorithm.adv_estimator={estimator}: {why}; set it to 1"
        )


def uses_rredcot_trainer(config: DictConfig) -> bool:
    """The rredcot trainer (verl's sync trainer plus the estimators' hooks, which counts failed groups for every
    estimator) replaces verl's sync mode; verl's async modes stay verl's for its own estimators."""
    from rredcot_verl.integration.trainer import SYNC_MODE, TRAINER_NAME

    return str(config.trainer.v1.trainer_mode) in (SYNC_MODE, TRAINER_NAME)


def select_trainer_mode(config: DictConfig, spec) -> None:
    """Refuse verl's async trainer modes for this package's estimators rather than silently replace them: their
    producers exist only in the sync trainer."""
    if spec is None:
        return
    from rredcot_verl.integration.trainer import SYNC_MODE, TRAINER_NAME

    mode = str(config.trainer.v1.trainer_mode)
    if mode not in (SYNC_MODE, TRAINER_NAME):
        raise LaunchError(
            f"trainer.v1.trainer_mode={mode} is not supported with algorithm.adv_estimator={spec.name}: its stages "
            f"run in verl's sync trainer (trainer.v1.trainer_mode={SYNC_MODE}, the default)"
        )


# ${oc.env:NAME} without a default: omegaconf raises at the first read of the key, inside hydra's traceback.
_REQUIRED_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")


def check_environment(config: DictConfig) -> None:
    """Refuse, naming it, an environment variable the config reads without a default (a recipe's ``DATA_DIR``) that
    is not set; then any other key whose value cannot be resolved, in one line."""
    from omegaconf.errors import OmegaConfBaseException

    def leaves(node, prefix=""):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from leaves(value, f"{prefix}{key}.")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from leaves(value, f"{prefix}{index}.")
        else:
            yield prefix[:-1], node

    for key, value in leaves(OmegaConf.to_container(config, resolve=False)):
        for name in _REQUIRED_ENV.findall(str(value)):
            if name not in os.environ:
                raise LaunchError(f"environment variable {name} is not set: {key} reads it ({value}); set it, e.g. "
                                  f"{name}=... python -m rredcot_verl.main ...")
    try:
        OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as error:
        raise LaunchError(f"the config does not resolve: {' '.join(str(error).split())}") from error


def check(config: DictConfig) -> list[str]:
    """Every launch check, in the order a user meets them; raises ``LaunchError`` with the first refusal. Returns
    the checks skipped because what they read is not on this machine (a hub model not in the local cache, remote
    dataset files): verl fetches those at start, where the same problems would fail late."""
    from rredcot_verl.integration.estimators import ESTIMATORS
    from rredcot_verl.integration.run_shapes import micro_batches, shape_refusal
    from rredcot_verl.tasks.code import code_task_refusal

    skipped: list[str] = []
    check_environment(config)
    estimator = str(config.algorithm.adv_estimator)
    check_estimator(estimator)
    spec = ESTIMATORS.get(estimator)
    select_trainer_mode(config, spec)
    check_value_pass_parallelism(config, estimator)
    try:  # the section's keys and values, before the data is read (the auto keys as for data without solutions)
        settings_from_config(config.algorithm, DataOffer(worked_solutions=None))
    except ValueError as error:
        raise LaunchError(str(error)) from error
    model_path = str(config.actor_rollout_ref.model.path)
    check_model_dir(model_path)
    check_dataset(config.data.train_files, "data.train_files", spec is not None, skipped)
    check_dataset(config.data.val_files, "data.val_files", spec is not None, skipped)
    choose_auto_settings(config, spec, skipped)
    settings = settings_from_config(config.algorithm)
    from transformers import AutoConfig, AutoTokenizer

    hf_config = _local_pretrained(AutoConfig, model_path)
    tokenizer = _local_pretrained(AutoTokenizer, model_path)
    if hf_config is None:
        skipped.append(f"model config of {model_path!r} (not local: attention kind, engine context)")
    prompt_lengths = sampled_prompt_lengths(config, tokenizer)
    if tokenizer is None:
        skipped.append(f"tokenizer of {model_path!r} (not local: prompt lengths)")
    else:
        check_prompt_lengths(config, prompt_lengths)
    refusal = (micro_batches(config) or shape_refusal(config, spec, hf_config)
               or (spec and code_task_refusal(settings, estimator)))
    if refusal:
        raise LaunchError(refusal)
    if spec is not None:
        check_task_answers(config, settings, skipped)
        check_worked_solutions(config, settings, spec)
        adopted = adopt_scorer_reward_range(config)
        if adopted:
            print(f"rredcot_verl: {adopted}")
    check_rule_reward(config, settings)
    check_ibpo_context(config, settings, hf_config, prompt_lengths)
    check_with_verl(config, skipped, model_is_local=hf_config is not None)
    return skipped


def check_with_verl(config: DictConfig, skipped: list[str], model_is_local: bool) -> None:
    """verl's own ``validate_config`` (batch sizes, micro-batch keys, the critic's model), which ``main_ppo`` runs
    before Ray: here its refusal is one line, and ``--check-only`` runs it too. On a copy: it may fill in derived
    values. Where the model is not on this machine a failure may only be the missing files: named as skipped."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    copy = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    try:
        validate_config(config=copy, use_reference_policy=need_reference_policy(copy), use_critic=need_critic(copy))
    except Exception as error:  # verl raises ValueError, AssertionError, hydra and omegaconf errors alike
        message = " ".join(str(error).split())
        if not model_is_local:
            skipped.append(f"verl's validate_config (the model is not on this machine: {message[:200]})")
            return
        raise LaunchError(f"verl's config check refuses it: {message}") from error


def profile_for_template_kwargs(config: DictConfig) -> None:
    """``probe.profile: auto`` reads the tokenizer's chat template, not the kwargs verl renders prompts with: with
    ``data.apply_chat_template_kwargs.enable_thinking: false`` the responses hold no thinking block (Qwen3's template
    closes an empty one in the prompt), which is the ``plain`` profile."""
    kwargs = config.data.get("apply_chat_template_kwargs", None) or {}
    probe = config.algorithm.get("rredcot", {}).get("probe", {})
    if kwargs.get("enable_thinking", True) is False and probe.get("profile", "auto") == "auto":
        _set(config, "algorithm.rredcot.probe.profile", "plain")
        print("rredcot_verl: data.apply_chat_template_kwargs.enable_thinking=false: algorithm.rredcot.probe.profile "
              "auto resolves to plain (responses without a thinking block)")


def say_cpu_strategy(config: DictConfig) -> None:
    """CPU mode replaces verl's FSDP1 (``strategy: fsdp``, verl's default) by FSDP2: FSDP1 wraps the model with
    ``FSDP(device_id=...)``, which needs an accelerator. On a GPU the strategy is left as set."""
    if config.actor_rollout_ref.actor.get("strategy", None) == "fsdp":
        print("rredcot_verl: CPU mode runs actor_rollout_ref.actor.strategy=fsdp2 instead of fsdp (verl's FSDP1 needs "
              "an accelerator)")


def prepare(config: DictConfig) -> DictConfig:
    """Check the config (``check``) and adapt it (trainer, CPU accommodations, Ray, plugin loading). Returns it."""
    cpu = use_cpu_mode()
    if cpu:
        # Before verl is first imported (check_estimator loads the plugin): verl resolves its platform on import,
        # and a VERL_PLATFORM=cpu already in the environment names a platform only enable_cpu_mode registers.
        os.environ.update(CPU_PROCESS_ENV)
        enable_cpu_mode()
    check(config)
    profile_for_template_kwargs(config)
    from rredcot_verl.integration.trainer import TRAINER_NAME

    if uses_rredcot_trainer(config):
        _set(config, "trainer.v1.trainer_mode", TRAINER_NAME)
    env = {"VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE}
    env.update({key: os.environ[key] for key in FORWARDED_ENV if key in os.environ})
    address = config.get("ray_kwargs", {}).get("ray_init", {}).get("address", None)
    if os.environ.get("RAY_ADDRESS"):
        print(f"rredcot_verl: connecting to the Ray cluster at {os.environ['RAY_ADDRESS']}")
    elif cpu and address is None:
        # A CPU run without a cluster named starts its own, with the fake GPUs verl's resource pools ask for, even
        # when another one runs on this machine (ray.init() would otherwise join it and refuse the resources).
        _set(config, "ray_kwargs.ray_init.address", "local")
        for key, value in local_cpu_cluster(config).items():
            _set(config, key, value)
    # Otherwise Ray is verl's: ray.init() joins a cluster brought up with `ray start` on this node, else starts one.
    if cpu:
        say_cpu_strategy(config)
        env.update(CPU_PROCESS_ENV)
        for key, value in CPU_CONFIG.items():
            _set(config, key, value)
        tensor_parallel = int(config.actor_rollout_ref.rollout.get("tensor_model_parallel_size", 1) or 1)
        if tensor_parallel == 1:
            # The engine core runs the model itself instead of in a worker process of its own (one vLLM import fewer
            # per server); verl's args put engine_kwargs after its own "mp" (tests/test_compat_on_cpu.py).
            _set(config, "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend", "uni")
        elif "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            try:
                env["VLLM_CPU_OMP_THREADS_BIND"] = vllm_thread_binding(tensor_parallel)
            except ValueError as error:
                raise LaunchError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tensor_parallel}: {error} "
                                  "(vLLM's CPU workers bind cores of their own)") from None
    os.environ.update(env)
    # Workers on a remote cluster do not inherit this process's environment: pass it through Ray's runtime_env.
    for key, value in env.items():
        _set(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{key}", value)
    return config


def run(config: DictConfig) -> None:
    launch(prepare(config))


def launch(config: DictConfig) -> None:
    """What verl's ``main_ppo.main`` does with a config: the V1 task runner with whichever trainer it selects, or
    verl's legacy task runner where ``trainer.use_v1=false`` (verl's own estimators only: ``run_shapes``)."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.trainer.get("use_v1", True):
        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from verl.trainer.main_ppo_v0 import TaskRunner

        run_ppo(config, task_runner_class=TaskRunner)


CHECK_ONLY_FLAG = "--check-only"


def check_only(config: DictConfig) -> None:
    """Every launch check on the composed config, without starting Ray or loading weights: ``ok`` or the refusal."""
    if use_cpu_mode():
        os.environ.update(CPU_PROCESS_ENV)
        enable_cpu_mode()
    skipped = check(config)
    print("rredcot_verl: ok" + (f"; skipped (not on this machine): {'; '.join(skipped)}" if skipped else ""))


# --check-only writes nothing: hydra's defaults would put an output folder (its config, a log file) in the working
# directory.
CHECK_ONLY_HYDRA = ("hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=stdout")
# Set while hydra composes the config: hydra then raises its composition errors (a key typo without "+") instead of
# printing them over several lines and exiting 1, and main() answers them as every refusal.
HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"


def composition_refusal(error: Exception) -> str:
    """hydra's composition error (and the omegaconf error under it) in one line: ``Could not override 'a.b'. To append
    to your config use +a.b=1 (Key 'b' is not in struct)``."""
    cause = error.__cause__
    detail = f" ({str(cause).splitlines()[0]})" if cause is not None and str(cause).strip() else ""
    return " ".join(str(error).split()) + detail


def main() -> None:
    """The command line: hydra's, plus ``--check-only`` (taken out before hydra parses the rest)."""
    from hydra.errors import CompactHydraException

    only_check = CHECK_ONLY_FLAG in sys.argv[1:]
    sys.argv = [arg for arg in sys.argv if arg != CHECK_ONLY_FLAG] + (list(CHECK_ONLY_HYDRA) if only_check else [])
    raise_composition_errors = HYDRA_FULL_ERROR not in os.environ
    if raise_composition_errors:
        os.environ[HYDRA_FULL_ERROR] = "1"

    # Defined here so that hydra's task function reads the flags above from this call, not from module globals.
    @hydra.main(config_path="../conf", config_name="rredcot_trainer", version_base=None)
    def hydra_task(config: DictConfig) -> None:
        if raise_composition_errors:
            os.environ.pop(HYDRA_FULL_ERROR)  # composed: errors of the run itself are reported as hydra reports them
        try:
            check_only(config) if only_check else run(config)
        except LaunchError as error:
            print(f"rredcot_verl: {error}", file=sys.stderr)
            sys.exit(2)

    try:
        hydra_task()
    except CompactHydraException as error:  # overrides that do not parse or compose: before any check ran
        print(f"rredcot_verl: {composition_refusal(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
