"""Rollout groups that verl's agent loop lost to an exception: counted every step, and the run stopped past a share.

When a session of a prompt raises (the reward function, the agent loop), verl's ``AgentLoopWorkerTQ._run_prompt`` logs
``Error in _run_prompt`` in its Ray worker, marks the prompt ``failure`` and carries on; the sync replay buffer still
hands the prompt to the trainer with only the traces whose sessions finished (none when all raised). A reward function
that raises on every parsed answer thus trains on the traces that gave no answer, and the run exits 0. Two pieces stop
that:

- ``install_error_recorder`` (run by the plugin in every verl process) keeps the first such error's traceback in Ray's
  internal key-value store under the job's id, where the trainer process (another Ray worker, possibly on another
  node) can read it;
- ``count_groups`` reads the sampled batch's keys (``{uid}_{session}``, verl's TransferQueue naming) against the
  number of prompts asked for and ``rollout.n``: a group with fewer traces than ``n``, or none, lost sessions.

The trainer logs ``rollout/failed_groups`` and ``rollout/failed_group_share`` each step and raises ``RolloutFailure``
with the first error once the share exceeds ``algorithm.rredcot.max_failed_group_share``.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

# verl's agent-loop logger and the message it logs for a session that raised (agent_loop_tq.py).
AGENT_LOOP_LOGGER = "verl.trainer.ppo.v1.agent_loop_tq"
AGENT_LOOP_ERROR = "Error in _run_prompt"
_KEY_PREFIX = "rredcot_verl/first_rollout_error/"
MAX_ERROR_CHARS = 6000


class RolloutFailure(RuntimeError):
    """Too many of a step's groups lost sessions to exceptions in verl's agent loop."""


def _key() -> bytes:
    import ray

    return (_KEY_PREFIX + ray.get_runtime_context().get_job_id()).encode()


class _FirstErrorRecorder(logging.Handler):
    """Stores the traceback of the first ``Error in _run_prompt`` of this Ray job (later ones are not written)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        if not record.getMessage().startswith(AGENT_LOOP_ERROR):
            return
        try:
            from ray.experimental import internal_kv

            if not internal_kv._internal_kv_initialized():
                return
            detail = "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else record.getMessage()
            internal_kv._internal_kv_put(_key(), detail[-MAX_ERROR_CHARS:].encode(), overwrite=False)
        except Exception:  # noqa: BLE001  (a logging handler must never raise into verl's agent loop)
            self.handleError(record)


def install_error_recorder() -> None:
    """Attach the recorder to verl's agent-loop logger (once per process)."""
    target = logging.getLogger(AGENT_LOOP_LOGGER)
    if not any(isinstance(handler, _FirstErrorRecorder) for handler in target.handlers):
        target.addHandler(_FirstErrorRecorder())


def first_error() -> str | None:
    """The first recorded agent-loop error of this Ray job, or None."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    value = internal_kv._internal_kv_get(_key())
    return value.decode() if value else None


@dataclass(frozen=True)
class GroupCount:
    """Groups of one sampled batch.

    Attributes:
        requested: prompts the trainer asked the replay buffer for.
        failed: groups with fewer than ``n`` traces, counting groups with none.
        missing_traces: traces the failed groups lack.
    """

    requested: int
    failed: int
    missing_traces: int

    @property
    def share(self) -> float:
        return self.failed / self.requested if self.requested else 0.0


def count_groups(keys: Iterable[str], requested: int, samples_per_prompt: int) -> GroupCount:
    """Count the groups of a batch that lost sessions.

    Args:
        keys: the batch's TransferQueue keys, ``{uid}_{session}`` (one per trace).
        requested: prompts asked for; prompts absent from ``keys`` lost every session.
        samples_per_prompt: ``actor_rollout_ref.rollout.n``.
    """
    sizes = Counter(str(key).split("_")[0] for key in keys)
    absent = max(requested - len(sizes), 0)
    short = [size for size in sizes.values() if size < samples_per_prompt]
    missing = absent * samples_per_prompt + sum(samples_per_prompt - size for size in short)
    return GroupCount(requested=requested, failed=absent + len(short), missing_traces=missing)
