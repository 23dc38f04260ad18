"""Where ``env.name`` leads: built-ins, entry points, ``package.module:factory``.

All three end in the same place, a factory called with ``env.args`` as keyword arguments
that returns the environment. The built-ins are a table of such ``module:factory``
strings, resolved exactly like a user's; installed packages add names through entry
points in the group ``rlcli.envs``; anything with a colon is imported as given (the
current directory is importable, as it is for ``python -m``). A user's environment needs
no change to rlcli.
"""

import importlib
import sys
from pathlib import Path
from typing import Any

from rlcli.errors import ConfigError

from rlcli.config.env import BUILTINS, ENTRY_POINT_GROUP, entry_point


def resolve(name: str) -> str:
    """``module:factory`` for ``name``."""
    if name in BUILTINS:
        return BUILTINS[name]
    if (spec := entry_point(name)) is not None:
        return spec
    if ":" in name:
        return name
    raise ConfigError(f"unknown env.name {name!r}: use a built-in ({', '.join(BUILTINS)}), an entry point "
                      f"in the group {ENTRY_POINT_GROUP}, or package.module:factory")


def load_factory(spec: str, key: str = "env.name", what: str = "factory"):
    """The callable ``package.module:attr`` names (``key``: the setting that named it, for errors).
    The working directory is importable, as for ``python -m``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key} {spec!r} must look like package.module:{what}")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key} {spec!r}: cannot import {module_name} ({e}); install it or add its "
                          "directory to PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} {spec!r}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key} {spec!r}: {attr} is not callable")
    return obj


def load_env(name: str, args: dict[str, Any]):
    """The environment ``name`` names, built from ``args``."""
    import inspect

    factory = load_factory(resolve(name))
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as e:
        raise ConfigError(f"env {name}: env.args do not fit its factory ({e})") from None
    except ValueError:
        pass  # no signature to check (a builtin or C callable)
    env = factory(**args)
    for method in ("sample_task", "reward"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(f"env {name}: the factory returned {type(env).__name__}, which has no {method}(); "
                              "an environment needs sample_task(rng) and reward(task, completion)")
    return env
