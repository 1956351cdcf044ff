"""Every verl method this package overrides and every private verl function, method or attribute it calls or relies
on, with why and what it relies on (``VERL_HOOKS``), as read in verl 0.9.1.

``tests/test_verl_hooks_on_cpu.py`` (the canary) checks each entry against the installed verl: that it exists, has
the recorded signature and, where an entry relies on verl's lines themselves, that their source still hashes to the
recorded value; and that every method of the trainer that verl's base class also defines is listed. On another verl,
``python -m rredcot_verl.integration.verl_hooks`` prints what the installed verl has, to compare and record once the
uses are re-checked (docs/usage.md, "Upgrading verl").
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass

# What the package does with the verl name.
OVERRIDE = "override"  # the rredcot trainer defines a method of verl's base class (and calls it as super())
CALL = "call"  # a private verl function or method called, or verl's lines whose behaviour a hook relies on
REPLACE = "replace"  # a verl module attribute replaced or subclassed (CPU mode, the entry-point guard, the workers)

TRAINER_BASE = "verl.trainer.ppo.v1.trainer_base"


@dataclass(frozen=True)
class VerlHook:
    """One verl name the package depends on.

    Attributes:
        name: ``module:Qualified.name`` in verl.
        kind: ``OVERRIDE``, ``CALL`` or ``REPLACE``.
        why: what this package uses it for.
        relies_on: what of verl's behaviour that use takes for granted (the lines to re-read on an upgrade).
        signature: ``str(inspect.signature(...))`` in verl 0.9.1; None for a class or attribute without one checked.
        source_sha256: hash of its normalised source (``source_hash``) in verl 0.9.1, where the use relies on its
            lines themselves (order of calls, what it passes, what it writes); None where the signature is enough.
    """

    name: str
    kind: str
    why: str
    relies_on: str
    signature: str | None = None
    source_sha256: str | None = None


VERL_HOOKS: tuple[VerlHook, ...] = (
    # ---- PPOTrainerSync / PPOTrainer methods the rredcot trainer (integration/trainer.py) overrides
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer.__init__", OVERRIDE,
        "reads the estimator's settings, then renames trainer.v1.trainer_mode from rredcot to sync before verl's "
        "__init__ reads it",
        "the base __init__ reads the mode from config.trainer.v1.trainer_mode into self.trainer_mode and takes its "
        "sync paths (ReplayBuffer, data.gen_batch_size) only for 'sync' (tests/test_trainer_mode_on_cpu.py)",
        signature="(self, config: omegaconf.dictconfig.DictConfig)",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._build_replay_buffer", OVERRIDE,
        "CPU mode polls the replay buffer for finished rollouts more often than verl's 2 s",
        "it returns the replay buffer whose poll_interval attribute its sample() sleeps between polls",
        signature="(self) -> verl.trainer.ppo.v1.replay_buffer.ReplayBuffer",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._init_resource_pool_mgr", OVERRIDE,
        "swaps the actor worker class for SegmentActorRolloutRefWorker (the value pass) after verl fills "
        "role_worker_mapping, and refuses a model the value pass cannot score first",
        "it fills self.role_worker_mapping (Role.Actor / ActorRollout / ActorRolloutRef) before any worker starts, "
        "after _init_tokenizer has fetched the model",
        signature="(self)",
        source_sha256="b61213e83aca8f403cd653cad31768eeeb6f65a63af2acd3eef9ee8699ac620a",
    ),
    VerlHook(
        "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_sample_end", OVERRIDE,
        "deferred while a stage generates before the log-prob pass; the trainer calls it once that stage is done",
        "it only puts the rollout replicas to sleep (checkpoint_manager.sleep_replicas) and stops rollout profiling",
        signature="(self)",
        source_sha256="9b2b9d07ded88cb7187eef57c2c7c8aa01ce9213c5aee03ad39fe575916d0b6e",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._compute_old_log_prob", OVERRIDE,
        "the estimator's stages run around verl's old-log-prob pass: before it with the engine awake, after it "
        "with its entropies",
        "it writes old_log_probs and entropy for the batch's rows to TransferQueue and returns the batch's metadata",
        signature="(self, batch: transfer_queue.metadata.KVBatchMeta, metrics: dict) -> "
                  "transfer_queue.metadata.KVBatchMeta",
        source_sha256="b12efefd019afa9bb18379cedfae43be60650e3595ca2a54a3fb8c9ce260dea8",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._compute_advantage", OVERRIDE,
        "runs as verl's for every estimator; for this package's, inside advantage_step, where the registered name "
        "gets the step's inputs; then the estimator's metrics, value gate and snapshot",
        "its lines: fetch of uid, response_mask, rm_scores, rollout_log_probs, old_log_probs; token_level_rewards = "
        "rm_scores without KL in reward (refused at launch); rollout correction outside bypass mode; "
        "compute_advantage_for_multi_trajectories with config.algorithm.adv_estimator; advantages, returns and the "
        "corrected response_mask / rollout_is_weights written back ragged. Nothing of its body is copied",
        signature="(self, batch: transfer_queue.metadata.KVBatchMeta, metrics: dict) -> "
                  "transfer_queue.metadata.KVBatchMeta",
        source_sha256="a6f0041cdc55837451722e531510b2339cd9f35048bfa8a21f88ad55a66d0bee",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._save_checkpoint", OVERRIDE,
        "writes the value gate's window into global_step_<n> before verl's save",
        "verl's save writes global_step_<n> under trainer.default_local_dir and marks it complete last "
        "(latest_checkpointed_iteration.txt, the checkpoint callback)",
        signature="(self)",
        source_sha256="856d1e34497c723a66a2d889d18af5fa4adc74a460aff9cc68a3352bf870df99",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._load_checkpoint", OVERRIDE,
        "restores the value gate's window saved beside verl's checkpoint",
        "it sets self.global_steps to the step resumed (0 without a checkpoint), from trainer.resume_from_path in "
        "resume_path mode, else from global_step_<n> under trainer.default_local_dir",
        signature="(self)",
        source_sha256="573f289a44a1da8c28965bf102eff4eb79c7e9520fe22654d0118475b55f70a9",
    ),
    # ---- verl's private lines the trainer's hooks rely on without overriding them
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._step_once", CALL,
        "the order the hooks are called in",
        "sample from the replay buffer, on_sample_end, reward, _balance_batch (padding rows tagged is_padding), "
        "_compute_old_log_prob, reference and critic passes, _compute_advantage, updates; batch.tags per row",
        signature="(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> "
                  "transfer_queue.metadata.KVBatchMeta",
        source_sha256="21f01977cde4719f69c7a39cd9e7b4b690c43249de42da056530656b804cf170",
    ),
    VerlHook(
        f"{TRAINER_BASE}:PPOTrainer._init_tokenizer", CALL,
        "the tests build the trainer without Ray and load its tokenizer as verl's init() does",
        "it sets self.tokenizer (the policy's), which the stages and the segmentation read",
        signature="(self)",
    ),
    VerlHook(
        "verl.trainer.ppo.v1.utils:compute_advantage_for_multi_trajectories", CALL,
        "verl's advantage step reaches the registered estimators through it",
        "for any estimator but GRPO it returns compute_advantage(data, ...) on the whole batch, rows unchanged",
        signature="(data: verl.protocol.DataProto, batch_keys: list[str], adv_estimator, gamma: float = 1.0, "
                  "lam: float = 1.0, num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True, config: Any = None) "
                  "-> verl.protocol.DataProto",
        source_sha256="0cd2f01e7e2a1ffd23001e3ef24390cd9ed7148845a32425300738e38cfdd01b",
    ),
    VerlHook(
        "verl.trainer.ppo.ray_trainer:compute_advantage", CALL,
        "calls the registered name of this package's estimators (base.register)",
        "a registered estimator is called with token_level_rewards, response_mask, config and index (uid), and its "
        "(advantages, returns) written to data.batch",
        signature="(data: verl.protocol.DataProto, adv_estimator: verl.trainer.ppo.core_algos.AdvantageEstimator, "
                  "gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True, "
                  "config: Optional[verl.trainer.config.algorithm.AlgoConfig] = None) -> verl.protocol.DataProto",
        source_sha256="f11acf8e1659affaedeb9c7732351e4d911205ca4cdb9ab348395eac34d5ebda",
    ),
    VerlHook(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__", CALL,
        "the CPU poll interval is set on the buffer verl built (_build_replay_buffer)",
        "poll_interval is kept as self.poll_interval and read at each poll",
        signature="(self, trainer_mode: str, trainer_config: omegaconf.dictconfig.DictConfig, "
                  "max_off_policy_threshold: int | None, max_off_policy_strategy: str, "
                  "sampler_kwargs: omegaconf.dictconfig.DictConfig, poll_interval: float = 2.0, refill_fn=None, "
                  "filter_groups_metric: str | None = None, train_batch_size: int | None = None, "
                  "gen_batch_size: int | None = None, max_inflight_gen_batches: int = 1, "
                  "sync_refill_failed_groups: bool = False)",
    ),
    VerlHook(
        "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ._run_prompt", CALL,
        "failures.py records the first error of a lost session from the log line it writes",
        "a session that raises is logged as 'Error in _run_prompt' on the verl.trainer.ppo.v1.agent_loop_tq "
        "logger, with the exception, and its traces are left out of the batch (no signature recorded: Ray's "
        "tracing gives the method one of its own; the source hash covers verl's)",
        source_sha256="2241608056c586c28ecca1277cbe4401aed42df2cfc508fac3d455c88832eb85",
    ),
    # ---- the weight-sync socket, named per Ray cluster (weight_sync.py)
    VerlHook(
        "verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter.__init__", REPLACE,
        "weight_sync wraps it to put the node's Ray id beside the job id in the sender's socket path",
        "it sets self.zmq_handle to ipc:///tmp/rl-colocate-zmq-{Ray job id}-replica-{r}-rank-{k}.sock, the path every "
        "weight sync's sender binds",
        signature="(self, config: verl.workers.config.rollout.RolloutConfig, model_config: "
                  "verl.workers.config.model.HFModelConfig, device_mesh: torch.distributed.device_mesh.DeviceMesh, "
                  "replica_rank: int = -1)",
        source_sha256="b77b5e7e967ca26aa6d53a22339d6cc7468347577f25eb4caf6edc9daf72bf2c",
    ),
    VerlHook(
        "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMReplica.__init__", REPLACE,
        "weight_sync wraps it to give the replica vllm_server.NamespacedHttpServer as its server class",
        "it sets self.server_class = ray.remote(vLLMHttpServer), from which launch_servers starts every server",
        signature="(self, replica_rank: int, config: verl.workers.config.rollout.RolloutConfig, model_config: "
                  "verl.workers.config.model.HFModelConfig, gpus_per_node: int = 8, is_reward_model: bool = False, "
                  "is_teacher_model: bool = False, name_suffix: str = '')",
        source_sha256="003ee2531fcf2a7d480aed7c251cc572d16caa0a0993b5394632d0e8c7801812",
    ),
    VerlHook(
        "verl.workers.rollout.vllm_rollout.vllm_async_server:vLLMHttpServer.__init__", CALL,
        "vllm_server.NamespacedHttpServer calls it, then sets VERL_RAY_JOB_ID to the cluster-unique id",
        "it sets VERL_RAY_JOB_ID in its own environment and starts no vLLM process (launch_server does, later)",
        signature="(self, config, model_config, rollout_mode: verl.workers.rollout.replica.RolloutMode, workers: "
                  "list[ray.actor.ActorHandle], replica_rank: int, node_rank: int, gpus_per_node: int, nnodes: int, "
                  "cuda_visible_devices: str, disaggregation_role: str = 'null', "
                  "disaggregation_kv_transfer_config: Optional[dict] = None)",
        source_sha256="af4bbda13d3060e7e3a160755a1b7b2f0f0ec60dae2a5b7e08aee03b958cbe77",
    ),
    VerlHook(
        "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension._get_zmq_handle", CALL,
        "weight_sync relies on the receiver naming its socket from VERL_RAY_JOB_ID",
        "it builds the same path as the sender's from VERL_RAY_JOB_ID, VERL_REPLICA_RANK and the local rank",
        signature="(self) -> str",
        source_sha256="18eaee9b5e5436fa2dde0feee256f07da2a60ce74eb81d6c70e98aa020ceb633",
    ),
    # ---- verl names replaced or subclassed
    VerlHook(
        "verl.utils.device:auto_set_device", REPLACE,
        "verl_entry_points wraps it to refuse these estimators under verl's own entry points before Ray starts",
        "each entry point imports it by name after `import verl` and calls it first with the composed config",
        signature="(config) -> None",
    ),
    VerlHook(
        "verl.plugin.platform.platform_manager:PlatformRegistry.register", CALL,
        "compat/cpu.py registers the CPU platform (PlatformCPU, a PlatformBase)",
        "a class registered under a name is the platform VERL_PLATFORM selects",
        signature="(platform: str)",
    ),
    VerlHook(
        "verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy", REPLACE,
        "compat/cpu.py replaces it with an unpinned policy on CPU (pinned memory needs an accelerator)",
        "the FSDP2 engine builds its offload policy through this module attribute",
    ),
    VerlHook(
        "verl.workers.engine_workers:ActorRolloutRefWorker", REPLACE,
        "SegmentActorRolloutRefWorker adds the value pass (workers.py)",
        "self.actor.engine has eval_mode() and module, the actor's model, once init_model ran",
    ),
)


def resolve(name: str):
    """The object ``module:Qualified.name`` names in the installed verl (AttributeError / ImportError if gone); a
    function wrapped by this package (``verl_entry_points``) or by Ray's tracing is read unwrapped, verl's own."""
    module_name, qualified = name.split(":")
    found = importlib.import_module(module_name)
    for part in qualified.split("."):
        found = getattr(found, part)
    return inspect.unwrap(found) if callable(found) else found


def source_hash(function) -> str:
    """``normalised_hash`` of a function's source."""
    return normalised_hash(inspect.getsource(function))


def normalised_hash(source: str) -> str:
    """sha256 of source text without its comments, blank lines and common indentation."""
    lines = textwrap.dedent(source).splitlines()
    kept = [re.sub(r"\s+#.*$", "", line).rstrip() for line in lines if not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(line for line in kept if line).encode()).hexdigest()


def observed(hook: VerlHook) -> tuple[str | None, str | None]:
    """The installed verl's signature and source hash of ``hook`` (each None where the entry records none)."""
    found = resolve(hook.name)
    signature = str(inspect.signature(found)) if hook.signature is not None else None
    digest = source_hash(found) if hook.source_sha256 is not None else None
    return signature, digest


if __name__ == "__main__":
    for hook in VERL_HOOKS:
        signature, digest = observed(hook)
        print(f"{hook.name}\n  signature: {signature}\n  source_sha256: {digest}")
