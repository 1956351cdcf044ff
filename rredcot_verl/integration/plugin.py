"""The ``verl.plugins`` entry point: importing this module registers everything rredcot-verl adds to verl.

verl imports it in each of its processes (entry point in ``setup.py``; the launcher also names it in
``VERL_USE_EXTERNAL_MODULES`` for workers on clusters where the package is installed without entry points). It applies
the CPU accommodations when ``RREDCOT_CPU=1``, keeps the first error of verl's agent loop for the trainer
(``failures.install_error_recorder``), names the weight-sync socket per Ray cluster (``weight_sync.install``), and
under verl's own entry points (``main_ppo``, the async ones) refuses these estimators before Ray starts
(``verl_entry_points.guard_verl_entry_points``). The estimators ``rredcot``, ``ibpo`` and ``segment_mc``
(``register_adv_est``; the trainer calls their advantage functions itself) and the trainer (``register_trainer``)
register when verl loads the module holding their registry, and the CPU-offload patch when verl loads its FSDP engine:
those modules take about 14 CPU-seconds to import, which most of a run's processes (vLLM servers, storage units, load
balancers) never need.
Importing it twice is harmless.
"""

from wrapt import register_post_import_hook

from rredcot_verl.compat import cpu_mode_requested, enable_cpu_mode
from rredcot_verl.compat.cpu import patch_fsdp2_offload_pinning
from rredcot_verl.integration.failures import install_error_recorder
from rredcot_verl.integration.verl_entry_points import guard_verl_entry_points
from rredcot_verl.integration.weight_sync import install as install_weight_sync_namespace

if cpu_mode_requested():
    enable_cpu_mode()


def _register_estimators(_core_algos) -> None:
    import rredcot_verl.integration.estimators  # noqa: F401


def _register_trainer(_trainer_base) -> None:
    import rredcot_verl.integration.trainer  # noqa: F401


def _unpin_fsdp2_offload(_transformer_impl) -> None:
    patch_fsdp2_offload_pinning()


# A hook on a module already loaded runs at once.
register_post_import_hook(_register_estimators, "verl.trainer.ppo.core_algos")
register_post_import_hook(_register_trainer, "verl.trainer.ppo.v1.trainer_base")
if cpu_mode_requested():
    register_post_import_hook(_unpin_fsdp2_offload, "verl.workers.engine.fsdp.transformer_impl")
install_error_recorder()
install_weight_sync_namespace()
guard_verl_entry_points()
