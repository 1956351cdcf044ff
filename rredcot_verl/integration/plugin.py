"""The ``verl.plugins`` entry point: importing this module registers everything rredcot-verl adds to verl.

verl imports it in each of its processes (entry point in ``setup.py``; the launcher also names it in
``VERL_USE_EXTERNAL_MODULES`` for workers on clusters where the package is installed without entry points). It applies
the CPU accommodations when ``RREDCOT_CPU=1``, then registers the estimators ``rredcot``, ``ibpo`` and ``segment_mc``
(``register_adv_est``) and the trainer (``register_trainer``), keeps the first error of verl's agent loop for the
trainer (``failures.install_error_recorder``), and under verl's async entry points refuses these estimators before
Ray starts (``run_shapes.guard_async_entry_points``). Importing it twice is harmless.
"""

from rredcot_verl.compat import cpu_mode_requested, enable_cpu_mode
from rredcot_verl.compat.cpu import patch_fsdp2_offload_pinning

if cpu_mode_requested():
    enable_cpu_mode()

from rredcot_verl.integration import estimators as _estimators  # noqa: E402,F401  (registers the estimators)
from rredcot_verl.integration.failures import install_error_recorder  # noqa: E402
from rredcot_verl.integration.run_shapes import guard_async_entry_points  # noqa: E402
from rredcot_verl.integration import trainer as _trainer  # noqa: E402,F401  (registers the trainer)

install_error_recorder()
guard_async_entry_points()
if cpu_mode_requested():
    patch_fsdp2_offload_pinning()
