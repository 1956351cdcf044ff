"""Every module of ``rredcot_verl.core`` can be star-imported, and every name its ``__all__`` lists exists."""

import importlib
import pkgutil

import pytest

import rredcot_verl.core

# walk_packages, not iter_modules: the modules of a sub-package (core.ibpo.*) have their own __all__.
CORE_MODULES = sorted(info.name for info in pkgutil.walk_packages(rredcot_verl.core.__path__, "rredcot_verl.core."))


def test_the_core_modules_are_found():
    assert {"rredcot_verl.core.ibpo", "rredcot_verl.core.ibpo.advantage", "rredcot_verl.core.redistribution"} <= set(
        CORE_MODULES
    )


@pytest.mark.parametrize("name", CORE_MODULES)
def test_star_import_gives_every_name_in_all(name):
    namespace = {}
    exec(f"from {name} import *", namespace)  # raises AttributeError on a listed name the module lacks
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        return
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    missing = [symbol for symbol in exported if symbol not in namespace or not hasattr(module, symbol)]
    assert not missing, f"{name}.__all__ lists names it does not define: {missing}"
