"""``integration/weight_sync``: two Ray clusters on one host get the same job id, so verl 0.9.1 would give their weight
syncs one socket; named per cluster, the sender's path and the one verl's receiver builds agree within a cluster and
differ between clusters."""

import json
import subprocess
import sys

import pytest

# verl's receiver module imports vllm
pytestmark = pytest.mark.vllm

PROBE = r"""
import json, os, types
import ray
from rredcot_verl.compat.cpu import enable_cpu_mode
enable_cpu_mode()
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from rredcot_verl.integration import weight_sync

os.environ["VERL_REPLICA_RANK"] = "0"
for _ in range(2):  # two clusters, one after the other
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    job = ray.get_runtime_context().get_job_id()
    adapter = types.SimpleNamespace()

    def servers_init():  # what ServerAdapter.__init__ sets (its source is pinned in verl_hooks)
        adapter.zmq_handle = f"ipc:///tmp/rl-colocate-zmq-{job}-replica-0-rank-0.sock"

    def http_servers_init():  # what vLLMHttpServer.__init__ sets (idem)
        os.environ["VERL_RAY_JOB_ID"] = job

    weight_sync._namespace_sender(servers_init, adapter, (), {})
    http_servers_init()
    weight_sync.name_receiver_socket()  # NamespacedHttpServer.__init__, after verl's
    sender = adapter.zmq_handle
    receiver = vLLMColocateWorkerExtension._get_zmq_handle(types.SimpleNamespace(model_runner=None, local_rank=0))
    try:
        weight_sync._namespace_sender(lambda: setattr(adapter, "zmq_handle", "ipc:///tmp/other.sock"), adapter, (),
                                      {})
        changed = None
    except RuntimeError as error:
        changed = str(error)
    print("PROBE " + json.dumps({"job": job, "sender": sender, "receiver": receiver, "changed": changed}))
    ray.shutdown()
"""


def _clusters() -> list[dict]:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return [json.loads(line[len("PROBE "):]) for line in result.stdout.splitlines() if line.startswith("PROBE ")]


def test_each_ray_cluster_names_its_own_weight_sync_socket():
    first, second = _clusters()
    # the flaw: a fresh cluster's first job always has the same id, so verl's own paths would coincide
    assert first["job"] == second["job"]
    for cluster in (first, second):
        assert cluster["sender"] == cluster["receiver"]
        assert cluster["sender"] != f"ipc:///tmp/rl-colocate-zmq-{cluster['job']}-replica-0-rank-0.sock"  # verl's
        assert len(cluster["sender"].removeprefix("ipc://").encode()) <= 107  # a Unix socket path's limit
        assert "weight_sync.py" in cluster["changed"] and "ipc:///tmp/other.sock" in cluster["changed"]
    assert first["sender"] != second["sender"]
