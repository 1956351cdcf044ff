"""verl's own entry points refuse this package's estimators before Ray starts (installed by the plugin in every
process; kept apart from ``run_shapes`` so that importing it loads none of the estimators).

The plugin registers the estimators in stock verl (the ``verl.plugins`` entry point), so verl's entry points accept
``algorithm.adv_estimator=rredcot``; none of their trainers runs the estimators' stages (segment data, values,
repairs), so such a run would pay for its rollouts and then fail at the first advantage."""

# verl's entry point -> why its trainer cannot serve the estimators
REFUSED_ENTRY_POINTS = {
    "verl.trainer.main_ppo": "its trainer runs none of the estimators' stages (segment data, values, repairs), "
                             "nor this package's launch checks",
    "verl.experimental.fully_async_policy.fully_async_main": "its stages run in verl's sync trainer",
    "verl.experimental.one_step_off_policy.main_ppo": "its stages run in verl's sync trainer",
}  # fmt: skip


def running_entry_point() -> str | None:
    """The dotted name of the ``__main__`` module (``python -m x.y`` or ``python path/to/x/y.py``), if importable."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name
    path = str(getattr(main, "__file__", "") or "").replace("\\", "/").removesuffix(".py")
    return next((name for name in REFUSED_ENTRY_POINTS if path.endswith(name.replace(".", "/"))), None)


def entry_point_refusal(entry_point: str | None, estimator: str) -> str | None:
    """The one-line refusal of ``estimator`` under verl's ``entry_point``, or None where it may run."""
    from rredcot_verl.integration.estimators import ESTIMATORS

    if entry_point not in REFUSED_ENTRY_POINTS or estimator not in ESTIMATORS:
        return None
    return (
        f"algorithm.adv_estimator={estimator} is not supported by {entry_point}: {REFUSED_ENTRY_POINTS[entry_point]}; "
        "launch with `python -m rredcot_verl.main` (the same overrides)"
    )


def guard_verl_entry_points() -> None:
    """Under one of verl's entry points, refuse this package's estimators before Ray starts.

    Each calls ``verl.utils.device.auto_set_device(config)`` first, with the composed config, and imports it by name
    after ``import verl`` has loaded this plugin. The entry point is read when it is called: under ``python -m`` the
    plugin loads while Python imports the module's parent packages, before ``__main__`` is the module."""
    import functools
    import sys

    import verl.utils.device as device

    original = device.auto_set_device
    if getattr(original, "guards_verl_entry_points", False):
        return

    @functools.wraps(original)  # verl's own stays reachable (inspect.unwrap): the verl_hooks canary reads it
    def auto_set_device(config):
        refusal = entry_point_refusal(running_entry_point(), str(config.algorithm.adv_estimator))
        if refusal:
            print(f"rredcot_verl: {refusal}", file=sys.stderr)
            sys.exit(2)
        return original(config)

    auto_set_device.guards_verl_entry_points = True
    device.auto_set_device = auto_set_device
