"""Everything that knows verl's internals: the plugin, estimators, worker method, trainer, rollouts, launcher."""
