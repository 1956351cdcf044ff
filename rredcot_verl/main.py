"""``python -m rredcot_verl.main``: verl's PPO entry point with the rredcot estimators (``integration/launcher.py``)."""

from rredcot_verl.integration.launcher import main

if __name__ == "__main__":
    main()
