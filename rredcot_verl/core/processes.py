"""The driver's per-trace work spread over worker processes, on the cores the driver has.

A step's driver work at the paper's scale (512 traces of 25k tokens) is seconds of Python per stage while every GPU
waits; what is independent per trace (probe planning once the group banks are built) is cut into one contiguous chunk
per worker and run in a pool of processes (threads would share one interpreter lock). The pool is started once per
driver process, on first use, with the ``spawn`` method (the driver is a Ray actor with threads of its own, which a
fork would copy mid-state), and kept for the next steps.

What every chunk of a call shares (settings, tokenizer, task) is pickled once per call and unpickled once per worker
and content: a worker keeps the last context it was sent, keyed by a digest of its bytes, so a run's tokenizer is
rebuilt once per worker, not once per step. Results come back in the order of the items, whatever the number of
workers. One worker, or too little work to pay for the dispatch, runs in the calling process: the same function on
the same items. As with any ``spawn`` pool, a script that calls this with several workers runs its work under
``if __name__ == "__main__":`` (each worker imports the script's main module).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence, TypeVar

import torch

__all__ = ["available_cores", "worker_count", "map_chunks", "worker_cpu_seconds"]

Item = TypeVar("Item")
Result = TypeVar("Result")

# Driver side: the pool, and the most workers it may start (it starts them as chunks arrive, one per busy chunk).
_pool: ProcessPoolExecutor | None = None
_pool_size = 0
# Worker side: the last context a worker was sent, by the digest of its pickled bytes.
_contexts: dict[str, Any] = {}
# Driver side: CPU seconds spent in workers by the chunks of every call so far (benchmarks read it).
_worker_cpu_seconds = 0.0


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(len(os.sched_getaffinity(0)), 1)
    return os.cpu_count() or 1


def worker_count(work: int, work_per_worker: int, cores: int | None = None) -> int:
    """Workers for ``work`` units: one per ``work_per_worker`` units (the dispatch of a chunk, its pickling and a
    round trip, must be small against its work), at most one per core, at least one."""
    if work_per_worker <= 0:
        raise ValueError(f"work_per_worker must be > 0, got {work_per_worker}")
    cores = available_cores() if cores is None else cores
    return max(1, min(cores, work // work_per_worker))


def worker_cpu_seconds() -> float:
    """CPU seconds the chunks of every :func:`map_chunks` call so far spent in worker processes, as the workers
    measured them: ``fn``'s, not the unpickling of a context (once per worker and context: once a run); the calling
    process's own share, pickling included, is in its own CPU time."""
    return _worker_cpu_seconds


def _one_thread() -> None:
    # The pool already has a process per core: torch's own threads in each would only compete for them.
    torch.set_num_threads(1)


def _pool_of(workers: int) -> ProcessPoolExecutor:
    """The driver's one pool, able to run ``workers`` chunks at once: sized to the cores (or to ``workers`` where that
    is more), so steps that ask for different numbers of workers share it; replaced only to grow past its size."""
    global _pool, _pool_size
    if _pool is None or workers > _pool_size:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool_size = max(workers, available_cores())
        _pool = ProcessPoolExecutor(max_workers=_pool_size, mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_one_thread)
    return _pool


def _chunks(items: Sequence[Item], count: int) -> list[Sequence[Item]]:
    """``items`` cut into ``count`` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), count)
    bounds = [0]
    for chunk in range(count):
        bounds.append(bounds[-1] + size + (chunk < extra))
    return [items[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _run_chunk(fn, digest: str, context_bytes: bytes, chunk):
    if digest not in _contexts:
        _contexts.clear()
        _contexts[digest] = pickle.loads(context_bytes)
    started = time.process_time()
    results = fn(_contexts[digest], chunk)
    return results, time.process_time() - started


def map_chunks(fn: Callable[[Any, Sequence[Item]], list[Result]], context: Any, items: Sequence[Item],
               workers: int) -> list[Result]:
    """``fn(context, items)``, computed as ``fn(context, chunk)`` over ``workers`` contiguous chunks of ``items`` in
    worker processes and concatenated, or in this process when ``workers`` is 1 or there is at most one item.

    ``fn`` returns one result per item of its chunk and must be a module-level function (workers import it by name);
    ``context``, ``items`` and the results must pickle. The pool starts a worker process the first time a chunk finds
    none idle, so a step asking for fewer workers starts no more. A worker that dies breaks the pool: the error is
    raised here and the next call starts a new pool.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(items) <= 1:
        return fn(context, items)
    global _pool, _worker_cpu_seconds
    context_bytes = pickle.dumps(context, protocol=pickle.HIGHEST_PROTOCOL)
    digest = hashlib.blake2b(context_bytes, digest_size=16).hexdigest()
    pool = _pool_of(workers)
    try:
        futures = [pool.submit(_run_chunk, fn, digest, context_bytes, chunk)
                   for chunk in _chunks(items, min(workers, len(items)))]
        results = []
        for future in futures:
            chunk_results, seconds = future.result()
            _worker_cpu_seconds += seconds
            results += chunk_results
    except BrokenProcessPool:
        _pool = None
        raise
    if len(results) != len(items):
        raise ValueError(f"{fn.__name__} returned {len(results)} results for {len(items)} items")
    return results
