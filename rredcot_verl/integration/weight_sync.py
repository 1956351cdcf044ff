"""Weight-sync sockets of their own for each Ray cluster on a host.

After every actor update verl 0.9.1 sends the weights to its colocated vLLM server over a ZMQ IPC socket named
``/tmp/rl-colocate-zmq-{job id}-replica-{r}-rank-{k}.sock``: the sender (``ServerAdapter``, in the actor's worker) takes
the job id from Ray, the receiver (vLLM's engine process) from ``VERL_RAY_JOB_ID``, which ``vLLMHttpServer`` sets from
Ray before it starts that process. The job id is meant to keep two jobs on one host apart, but every Ray cluster
numbers its jobs from the same first id, so two runs that each start their own cluster (two experiments on one node,
two CPU launches side by side) name the same socket: the sender removes and rebinds the path at every sync and removes
it when done, so one run's sync takes the other's socket and a receiver then waits forever (a CI launch hung at its
first sync this way).

``install`` (run by the plugin in every verl process) puts the node's Ray id beside the job id in both names: the
sender and its colocated receiver share a node, and no two clusters share a node id. The sender is wrapped where verl
builds it; the server is an actor, and Ray runs an actor class's own methods, not wrappers put on them in the worker,
so verl's replica is given a subclass of the server instead (``vllm_server.NamespacedHttpServer``).
"""

from __future__ import annotations

import os

from wrapt import register_post_import_hook, wrap_function_wrapper

SENDER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_rollout"
REPLICA_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"
# the receiver's variable (verl's vllm_rollout/utils.py, _get_zmq_handle)
JOB_ID_ENV = "VERL_RAY_JOB_ID"
# Enough of the node id (56 random hex digits) to tell clusters apart; a Unix socket path holds at most 107 bytes.
NODE_ID_CHARS = 12
_installed = False


def cluster_job_id() -> str:
    """``{job id}-{node id prefix}``: the job id verl names the socket by, made unique among Ray clusters."""
    import ray

    context = ray.get_runtime_context()
    return f"{context.get_job_id()}-{context.get_node_id()[:NODE_ID_CHARS]}"


def name_receiver_socket() -> None:
    """Set the receiver's job id (after verl's server has set its own, before it starts vLLM's engine process)."""
    os.environ[JOB_ID_ENV] = cluster_job_id()


def _namespace_sender(wrapped, instance, args, kwargs):
    import ray

    wrapped(*args, **kwargs)
    verls = f"-zmq-{ray.get_runtime_context().get_job_id()}-"
    if verls not in instance.zmq_handle:
        raise RuntimeError(f"verl's weight-sync socket {instance.zmq_handle!r} no longer holds the Ray job id as "
                           f"{verls!r}: re-read rredcot_verl/integration/weight_sync.py against this verl")
    instance.zmq_handle = instance.zmq_handle.replace(verls, f"-zmq-{cluster_job_id()}-", 1)


def _namespaced_server_class(wrapped, instance, args, kwargs):
    import ray

    from rredcot_verl.integration.vllm_server import NamespacedHttpServer

    wrapped(*args, **kwargs)
    instance.server_class = ray.remote(NamespacedHttpServer)


def _wrap_sender(module) -> None:
    wrap_function_wrapper(module, "ServerAdapter.__init__", _namespace_sender)


def _wrap_replica(module) -> None:
    wrap_function_wrapper(module, "vLLMReplica.__init__", _namespaced_server_class)


def install() -> None:
    """Wrap both when verl loads their modules (at once where loaded). Installing twice is harmless."""
    global _installed
    if _installed:
        return
    _installed = True
    register_post_import_hook(_wrap_sender, SENDER_MODULE)
    register_post_import_hook(_wrap_replica, REPLICA_MODULE)
