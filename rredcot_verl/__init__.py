"""rredcot-verl: segment-level credit assignment (RREDCoT, IBPO, segment MC) for stock verl.

Layers (each imports only the ones above it):

- ``rredcot_verl.core``: the algorithms (segmentation, probes, values, redistribution, IBPO, Monte-Carlo aggregation).
  torch, transformers and rapidfuzz only: importable where verl and ray are not installed.
- ``rredcot_verl.tasks``: task adapters (answer extraction, step splitting, first wrong step) and the embedded task.
- ``rredcot_verl.integration``: everything that knows verl's internals. ``rredcot_verl.integration.plugin`` is the
  ``verl.plugins`` entry point that registers the estimators and the trainer.

Importing this package itself is cheap and registers nothing.
"""

__version__ = "0.1.0"
