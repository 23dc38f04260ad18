"""Config schemas (msgspec structs, no torch import) and recipe loading."""

from rlcli.config.load import load_recipe, dump_toml, to_dict
from rlcli.config.recipe import RecipeConfig

__all__ = ["RecipeConfig", "load_recipe", "dump_toml", "to_dict"]
