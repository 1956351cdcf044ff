"""verl's async entry points refuse this package's estimators before Ray starts (installed by the plugin in every
process; kept apart from ``run_shapes`` so that importing it loads none of the estimators)."""

# verl's entry points whose trainers have no hook for the estimators' stages (their own rollouter/trainer classes).
ASYNC_ENTRY_POINTS = (
    "verl.experimental.fully_async_policy.fully_async_main",
    "verl.experimental.one_step_off_policy.main_ppo",
)


def running_entry_point() -> str | None:
    """The dotted name of the ``__main__`` module (``python -m x.y`` or ``python path/to/x/y.py``), if importable."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name
    path = str(getattr(main, "__file__", "") or "").replace("\\", "/").removesuffix(".py")
    return next((name for name in ASYNC_ENTRY_POINTS if path.endswith(name.replace(".", "/"))), None)


def guard_async_entry_points() -> None:
    """Under one of verl's async entry points, refuse this package's estimators before Ray starts.

    Both call ``verl.utils.device.auto_set_device(config)`` first, with the composed config, and import it by name
    after ``import verl`` has loaded this plugin. The entry point is read when it is called: under ``python -m`` the
    plugin loads while Python imports the module's parent packages, before ``__main__`` is the module."""
    import sys

    import verl.utils.device as device

    original = device.auto_set_device
    if getattr(original, "guards_async_entry_points", False):
        return

    def auto_set_device(config):
        from rredcot_verl.integration.estimators import ESTIMATORS

        entry, estimator = running_entry_point(), str(config.algorithm.adv_estimator)
        if entry in ASYNC_ENTRY_POINTS and estimator in ESTIMATORS:
            print(
                f"rredcot_verl: algorithm.adv_estimator={estimator} is not supported by {entry}: its stages run in "
                "verl's sync trainer; launch with `python -m rredcot_verl.main`",
                file=sys.stderr,
            )
            sys.exit(2)
        return original(config)

    auto_set_device.guards_async_entry_points = True
    device.auto_set_device = auto_set_device
