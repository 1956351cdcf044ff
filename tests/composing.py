"""Hydra's ``compose`` for tests that compose one recipe with many sets of overrides, at a fraction of the cost.

A compose of a recipe on verl's config takes about a second here, and the launch-check tests make a few hundred. Each
recipe is composed once; a call's overrides, when every key is a config path (``a.b=v``, ``+a.b=v``, ``~a.b``), are
applied to a copy by hydra's own override code, the step ``compose`` takes after merging the defaults list. Anything
else (a config-group choice such as ``data=...``, a ``hydra.`` key) goes through a full compose. The first call with
overrides on each recipe is also composed in full, and the two must be equal.
"""

from __future__ import annotations

import copy

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

_PARSER = OverridesParser.create()
_RECIPES: dict[tuple[str, str], DictConfig] = {}
_COMPARED: set[tuple[str, str]] = set()


def compose_recipe(config_dir: str, name: str, overrides=()) -> DictConfig:
    """``compose(config_name=name, overrides=overrides)`` under ``config_dir``, as a fresh config the caller may
    change."""
    overrides = list(overrides)
    parsed = _PARSER.parse_overrides(overrides)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        if any("." not in o.key_or_group or o.key_or_group.startswith("hydra.") for o in parsed):
            return compose(config_name=name, overrides=overrides)
        key = (config_dir, name)
        if key not in _RECIPES:
            _RECIPES[key] = compose(config_name=name)
        config = copy.deepcopy(_RECIPES[key])
        ConfigLoaderImpl._apply_overrides_to_config(parsed, config)
        if overrides and key not in _COMPARED:
            _COMPARED.add(key)
            full = compose(config_name=name, overrides=overrides)
            assert OmegaConf.to_yaml(config) == OmegaConf.to_yaml(full) and OmegaConf.is_struct(config), key
    return config
