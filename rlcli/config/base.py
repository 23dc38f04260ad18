"""Base struct for every config section.

Sections are keyword-only, reject unknown keys, and carry a one-line docstring
under each field (``tests/test_config.py`` checks that every field has one).
"""

import msgspec


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    """A config section: a TOML table in a recipe."""
