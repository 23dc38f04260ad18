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
