"""README opens with the two commands (demo, tests), and CI runs exactly the second."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_demo_and_test_commands():
    demo, tests = readme_commands()[:2]
    assert "rl-orchestrate up recipes/reverse.toml" in demo and "torch==2.13.0" in demo
    assert "pytest" in tests and "torch==2.13.0" in tests


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == readme_commands()[1]


def test_the_engine_table_lists_each_engines_own_keys():
    """README's rl-infer table names every key of each engine's config (`infer.engine.*`), no more."""
    import re

    import msgspec

    from rlcli.config.infer import NativeEngineConfig, VllmEngineConfig

    text = (REPO / "README.md").read_text()
    for cfg in (NativeEngineConfig, VllmEngineConfig):
        name = cfg.__struct_config__.tag
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}`"))
        listed = set(re.findall(r"`(\w+)`", row.rsplit("|", 2)[-2]))
        assert listed == {f.name for f in msgspec.structs.fields(cfg)} - {"name"}, name


def test_the_settings_a_run_must_agree_on_are_the_ones_readme_names():
    """README names the settings live processes must agree on; SHARED_SETTINGS is what they register
    and compare, and each role registers the ones it shares."""
    import re

    from rlcli.config import load_recipe
    from rlcli.config.recipe import SHARED_SETTINGS, shared_settings

    text = " ".join((REPO / "README.md").read_text().split())
    named = re.search(r"So is one whose settings shared with a live peer differ: (.*?) \(", text).group(1)
    assert set(re.findall(r"`([\w.]+)`", named)) == set(SHARED_SETTINGS)
    cfg = load_recipe(REPO / "recipes" / "reverse.toml")
    assert set(shared_settings(cfg, "train")) == set(SHARED_SETTINGS)  # the trainer shares every one
    assert set(shared_settings(cfg, "infer")) == {"r3"} and set(shared_settings(cfg, "sync")) == {"sync.backend.kind"}
    assert set(shared_settings(cfg, "orchestrate")) == {"num_steps", "r3", "train.micro_batch_tokens"}
