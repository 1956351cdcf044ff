"""rredcot-verl: segment-level credit assignment (RREDCoT, IBPO, segment MC) for stock verl.

Importing the package registers the advantage estimators ``rredcot``, ``ibpo`` and ``segment_mc`` with verl's
``register_adv_est`` and the trainer mode ``rredcot`` with verl's ``register_trainer``; importing twice is harmless.
verl loads this package in every one of its processes through the ``verl.plugins`` entry point, which is also where
the CPU accommodations (``rredcot_verl.compat``) are applied when ``RREDCOT_CPU=1``.
"""

from rredcot_verl.compat import cpu_mode_requested, enable_cpu_mode

if cpu_mode_requested():
    enable_cpu_mode()

from rredcot_verl import estimators as _estimators  # noqa: E402,F401  (registers rredcot, ibpo, segment_mc)
from rredcot_verl import trainer as _trainer  # noqa: E402,F401  (registers trainer mode "rredcot")

__version__ = "0.1.0"
