"""verl's vLLM server with its weight-sync socket named per Ray cluster (``weight_sync``). Imported only where verl's
vLLM server module is: by the replica that starts the server, and by the server's Ray worker when it loads the class."""

from __future__ import annotations

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

from rredcot_verl.integration.weight_sync import name_receiver_socket


class NamespacedHttpServer(vLLMHttpServer):
    """``vLLMHttpServer``, then the receiver's job id made unique among clusters (``weight_sync.name_receiver_socket``)
    before ``launch_server`` starts vLLM's engine process, which inherits it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        name_receiver_socket()
