"""The value pass under torch.distributed: two processes over gloo, a tiny Qwen2 sharded with FSDP2 (each forward
all-gathers parameters), different shards (one rank has no probes at all, the other several micro-batches). Every rank
must make the same number of model forwards, and the run must finish (a missing all-gather would hang)."""

import random
import socket

import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.core.probes import Probe
from rredcot_verl.core.values import score_plans

TIMEOUT_S = 120
VOCAB = 64


def _model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def _shards():
    """Rank 0: four traces with exit-style probes (three micro-batches at a 64-token budget); rank 1: an empty
    response and a trace whose group had no candidate (no probes, so no forward of its own)."""
    rng = random.Random(0)
    ids = lambda n: torch.tensor([rng.randrange(VOCAB) for _ in range(n)], dtype=torch.long)  # noqa: E731
    busy = []
    for length in (40, 25, 21, 12):
        ends = [length // 2, length]
        probes = [Probe(b, [3, 4], [5, 6 + k], value_index=g) for g, b in enumerate((0, length // 2)) for k in range(2)]
        busy.append(TraceRecord(ids(5), ids(length), None, 1.0, "g", segment_ends=ends, probes=probes, value_rule="raw"))
    idle = [
        TraceRecord(ids(4), ids(0), None, 0.0, "g"),
        TraceRecord(ids(6), ids(30), None, 0.0, "h", segment_ends=[15, 30], value_rule="raw", no_candidates=True),
    ]
    return [busy, idle]


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        model = _model()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        forwards = []
        model.register_forward_hook(lambda *args: forwards.append(1))
        _, raw_values, metrics = score_plans(model, _shards()[rank], max_segments=2, max_token_len=64)
        torch.save({"forwards": len(forwards), "values": raw_values, "metrics": metrics}, out)
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ranks_make_the_same_number_of_forwards_and_finish(tmp_path):
    context = mp.get_context("spawn")
    port = _free_port()
    outs = [str(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    processes = [context.Process(target=_worker, args=(rank, 2, port, outs[rank])) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(TIMEOUT_S)
    hung = [p.pid for p in processes if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
    assert not hung, f"value pass did not finish within {TIMEOUT_S} s (ranks out of step in FSDP's all-gathers)"
    assert [p.exitcode for p in processes] == [0, 0]

    busy, idle = (torch.load(out) for out in outs)
    assert busy["metrics"]["rredcot/value_micro_batches"] == 3 and busy["metrics"]["rredcot/value_dummy_forwards"] == 0
    assert idle["metrics"]["rredcot/value_micro_batches"] == 0 and idle["metrics"]["rredcot/value_dummy_forwards"] == 3
    assert busy["forwards"] == idle["forwards"] == 3
    # The sharded run's values are the single-process ones.
    _, expected, _ = score_plans(_model(), _shards()[0], max_segments=2, max_token_len=64)
    torch.testing.assert_close(busy["values"], expected, rtol=1e-5, atol=1e-6)
    assert torch.isnan(idle["values"][:, :2]).all()
