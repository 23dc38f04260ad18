"""Recipe loading: TOML file, then flags, then dotted overrides, then validation.

Precedence (lowest to highest): struct defaults < recipe file < real flags < dotted
overrides (``--train.optim.lr 3e-6`` or ``--train.optim.lr=3e-6``). Values of dotted
overrides are read as TOML literals (``3e-6``, ``true``, ``[1, 2]``) and fall back to
strings. Every error names the key to change.

Setting the ``name`` of a tagged-union table from the command line to another variant
(``--engine vllm`` on a recipe whose ``[infer.engine]`` is native) starts that table
afresh: the recipe's keys belong to the other variant.
"""

import re
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping

import msgspec

from rlcli.config.env import migrate_env_table
from rlcli.config.recipe import RecipeConfig
from rlcli.errors import ConfigError

_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")


def parse_value(text: str) -> Any:
    """A dotted override's value: a TOML literal when it parses as one, else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """``["--a.b", "1", "--c.d=x"]`` -> ``{"a.b": 1, "c.d": "x"}``; anything else is an error."""
    out: dict[str, Any] = {}
    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key VALUE")
        key, eq, value = arg[2:].partition("=")
        if "." not in key and key.replace("-", "_") not in RecipeConfig.__struct_fields__:  # a mistyped flag
            raise ConfigError(f"no such option --{key} (see --help; recipe keys take --section.key VALUE)")
        if not eq:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and not _is_number(args[i + 1])):
                raise ConfigError(f"override --{key} needs a value: --{key} VALUE")
            value = args[i + 1]
            i += 1
        out[key.replace("-", "_")] = parse_value(value)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {part} is a value, not a table")
        node = child
    node[parts[-1]] = value


def get_dotted(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "not found"
        raise ConfigError(f"recipe {path} {what}; give the path of a TOML recipe (see recipes/)")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); a recipe is a TOML file") from None


def load_recipe(
    path: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RecipeConfig:
    """Build and validate a recipe. ``flags`` maps dotted keys to values (None = not given)."""
    tree: dict[str, Any] = read_toml(path) if path else {}
    migrate_env_table(tree.get("env"))  # the recipe's own first: --env.args.<key> then beats its [env] <key>
    given = {k: v for k, v in {**(flags or {}), **(overrides or {})}.items() if v is not None}
    for key, value in sorted(given.items(), key=lambda kv: not kv[0].endswith(".name")):
        if key.endswith(".name"):
            table = get_dotted(tree, key.rpartition(".")[0])
            if isinstance(table, dict) and table.get("name", value) != value:
                table.clear()  # another variant of a tagged union: the recipe's keys are not its keys
        set_dotted(tree, key, value)
    source = str(path) if path else "command line"
    migrate_env_table(tree.get("env"))
    try:
        return msgspec.convert(tree, RecipeConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {describe_validation_error(str(e))}") from None


def describe_validation_error(message: str) -> str:
    """Turn msgspec's ``... - at `$.a.b``` into a message that names the key ``a.b``."""
    at = _PATH_RE.search(message)
    where = at.group(1) if at else ""
    what = _PATH_RE.sub("", message)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", what)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return f"unknown key '{key}'"
    missing = re.match(r"Object missing required field `([^`]*)`", what)
    if missing:
        key = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return f"missing key '{key}'"
    if where and where.endswith(".name") and "Invalid value" in what:
        return f"unknown {where} {what.split('Invalid value', 1)[1].strip()}"
    named = what.startswith((where, where.split(".")[-1])) if where else True  # a check's own message names its key
    return what if named else f"{where}: {what}"


def to_dict(cfg: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def dump_toml(data: Mapping[str, Any]) -> str:
    """A small TOML writer for config trees: tables, scalars, and lists of scalars, lists or inline
    tables (a mixture's ``env.args.envs``); keys that are not bare TOML keys are quoted."""
    lines: list[str] = []

    def emit(table: Mapping[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix and (scalars or not tables):
            lines.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            if v is not None:
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        for k, v in tables.items():
            emit(v, f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k))

    emit(data, "")
    return "\n".join(lines).lstrip("\n") + "\n"


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else _toml_value(str(k))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
