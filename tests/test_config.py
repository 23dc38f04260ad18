import ast
import inspect
import os
import tomllib
from pathlib import Path

import msgspec
import pytest

from rlcli.config import RecipeConfig, dump_toml, load_recipe, to_dict
from rlcli.config.load import parse_overrides
from rlcli.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.toml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses(recipe):
    cfg = load_recipe(recipe)
    assert cfg.name


def test_there_are_recipes():
    assert any(p.name == "reverse.toml" for p in RECIPES)


def _config_structs():
    import rlcli.config.env as env
    import rlcli.config.infer as infer
    import rlcli.config.model as model
    import rlcli.config.orchestrate as orch
    import rlcli.config.recipe as recipe
    import rlcli.config.services as services
    import rlcli.config.train as train

    for module in (env, infer, model, orch, recipe, services, train):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__:
                yield obj


def test_every_config_field_has_a_docstring():
    missing = []
    for cls in _config_structs():
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                    missing.append(f"{cls.__name__}.{node.target.id}")
    assert not missing, f"fields without a docstring: {missing}"


def test_config_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, rlcli.config, rlcli.protocol; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("overrides, expected", [
    (["--train.optim.lrr", "1"], "unknown key 'train.optim.lrr'"),
    (["--bogus.key", "1"], "unknown key 'bogus'"),
    (["--model.dtype", "int3"], "model.dtype"),
    (["--num_steps", "many"], "num_steps"),
    (["--env.name", "chess"], "env.name"),
    (["--orchestrate.max_off_policy_steps", "-1"], "max_off_policy_steps"),
    (["--orchestrate.sampling.temperature", "0"], "temperature"),
    (["--model.max_seq_len", "64", "--train.micro_batch_tokens", "32"], "micro_batch_tokens"),
    (["--infer.device", "gpu"], "infer.device"),
    (["--infer.engine.name", "tpu"], "infer.engine.name"),
    (["--infer.engine.name", "vllm", "--infer.engine.block_size", "16"], "infer.engine.block_size"),
    (["--infer.engine.name", "vllm", "--infer.engine.paged_decode", "true"], "infer.engine.paged_decode"),
    (["--infer.http_port", "70000"], "infer.http_port"),
    (["--infer.engine.name", "vllm", "--infer.engine.tensor_parallel_size", "0"], "infer.engine.tensor_parallel_size"),
    (["--infer.engine.name", "vllm", "--infer.engine.expert_parallel", "true"], "infer.engine.expert_parallel"),
    (["--train.fp8.graph", "inline"], "train.fp8.graph"),
    (["--train.fp8.enabled", "true", "--infer.fp8.enabled", "true", "--infer.fp8.exclude", "['lm_head']"],
     "train.fp8 and infer.fp8 are both on but quantize differently"),
    (["--train.loss.kind", "tis", "--train.loss.mask_low", "0.2"], "train.loss.mask_low (0.2) has no effect"),
    (["--orchestrate.group_size", "8", "--infer.max_num_seqs", "4"], "orchestrate.group_size (8) must be <= infer"),
])
def test_bad_values_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_recipe(None, {}, parse_overrides(overrides))
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_in_recipe_file(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text('name = "x"\n[train]\nmicro_batch_tokenz = 3\n')
    with pytest.raises(ConfigError, match=r"x.toml: unknown key 'train.micro_batch_tokenz'"):
        load_recipe(p)


def test_precedence_file_then_flags_then_overrides(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text('name = "x"\nnum_steps = 3\n[train.optim]\nlr = 0.1\n')
    cfg = load_recipe(p, {"num_steps": 5, "train.optim.lr": None}, parse_overrides(["--train.optim.lr=0.2"]))
    assert cfg.num_steps == 5 and cfg.train.optim.lr == 0.2
    assert cfg.run_dir == "runs/x"


def test_override_values_are_toml_literals():
    o = parse_overrides(["--a.b", "3", "--a.c", "true", "--a.d", "[1, 2]", "--a.e", "hello", "--a.f", "-1"])
    assert o == {"a.b": 3, "a.c": True, "a.d": [1, 2], "a.e": "hello", "a.f": -1}


def test_flag_without_dot_is_rejected():
    with pytest.raises(ConfigError, match="no such option --lr"):
        parse_overrides(["--lr", "1"])


def test_dump_toml_round_trips():
    cfg = load_recipe(REPO / "recipes" / "reverse.toml")
    text = dump_toml(to_dict(cfg))
    again = msgspec.convert(tomllib.loads(text), RecipeConfig)
    assert again == cfg


def test_dump_toml_writes_inline_tables_in_lists_and_quotes_odd_keys():
    args = {"envs": [{"name": "math", "weight": 3.0, "args": {"verifier": "numeric"}},
                     {"name": "pkg.mod:Env", "args": {"a b": [1, 2], "x.y": {"z": "q\"uote"}}}]}
    cfg = load_recipe(REPO / "recipes" / "reverse.toml", {"env.name": "mix", "env.args": args})
    text = dump_toml(to_dict(cfg))
    assert tomllib.loads(text)["env"]["args"] == args
    assert msgspec.convert(tomllib.loads(text), RecipeConfig) == cfg


def test_off_policy_bound_defaults_to_max_async():
    cfg = load_recipe(None, {"orchestrate.max_async": 2})
    assert cfg.orchestrate.off_policy_bound == 2
    cfg = load_recipe(None, {"orchestrate.max_async": 2, "orchestrate.max_off_policy_steps": 1})
    assert cfg.orchestrate.off_policy_bound == 1
    cfg = load_recipe(None, {"orchestrate.max_async": 2, "orchestrate.max_off_policy_steps": 6})
    assert cfg.orchestrate.off_policy_bound == 6


def test_switching_the_engine_drops_the_other_engines_recipe_keys():
    from rlcli.config.infer import NativeEngineConfig, VllmEngineConfig

    recipe = REPO / "recipes" / "reverse.toml"
    vllm = load_recipe(recipe, {"infer.engine.name": "vllm"}, {"infer.engine.enforce_eager": True})
    assert isinstance(vllm.infer.engine, VllmEngineConfig) and vllm.infer.engine.enforce_eager
    native = load_recipe(recipe, {"infer.engine.name": "native", "infer.device": "cuda:1"})
    assert isinstance(native.infer.engine, NativeEngineConfig) and native.infer.engine.kv_cache_memory_mb == 64
    assert native.infer.engine.name == "native" and native.infer.device == "cuda:1"


def test_vllm_cpu_core_sets_must_match_its_workers(monkeypatch):
    """vLLM binds CPU worker k to the k-th "|"-separated core set; a count that does not match the tensor-parallel
    size is one clear error naming the variable (vLLM itself would fail an assert inside a worker)."""
    from rlcli.infer.vllm_engine import _setup_environment

    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):  # it sets them; restored after
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(ConfigError, match="VLLM_CPU_OMP_THREADS_BIND='0' gives 1 core set") as e:
        _setup_environment("cpu", 1.0, tp=2)
    assert "\n" not in str(e.value)
    _setup_environment("cpu", 1.0, tp=1)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    _setup_environment("cpu", 1.0, tp=2)
    assert len(os.environ["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2


def test_fp8_on_one_side_only_or_alike_on_both_is_accepted():
    load_recipe(None, {}, parse_overrides(["--infer.fp8.enabled", "true", "--infer.fp8.exclude", "['lm_head']"]))
    load_recipe(None, {}, parse_overrides(["--train.fp8.enabled", "true", "--infer.fp8.enabled", "true",
                                           "--train.fp8.backend", "torch"]))  # kernels may differ


REVERSE = REPO / "recipes" / "reverse.toml"


@pytest.mark.parametrize("key, value, expected", [
    # train.optim
    ("train.optim.max_grad_norm", "-1", "train.optim.max_grad_norm must be >= 0 (0 turns clipping off), got -1"),
    ("train.optim.max_grad_norm", "nan", "train.optim.max_grad_norm must be >= 0"),
    ("train.optim.lr", "0", "train.optim.lr (--lr) must be > 0 and finite"),
    ("train.optim.lr", "-1e-5", "train.optim.lr (--lr) must be > 0 and finite"),
    ("train.optim.lr", "nan", "train.optim.lr (--lr) must be > 0 and finite, got nan"),
    ("train.optim.lr", "inf", "train.optim.lr (--lr) must be > 0 and finite, got inf"),
    ("train.optim.beta1", "1", "train.optim.beta1 must be in [0, 1)"),
    ("train.optim.beta1", "-0.1", "train.optim.beta1 must be in [0, 1)"),
    ("train.optim.beta2", "1.0", "train.optim.beta2 must be in [0, 1)"),
    ("train.optim.beta2", "nan", "train.optim.beta2 must be in [0, 1)"),
    ("train.optim.eps", "0", "train.optim.eps must be > 0 and finite"),
    ("train.optim.eps", "inf", "train.optim.eps must be > 0 and finite"),
    ("train.optim.weight_decay", "-0.1", "train.optim.weight_decay must be >= 0 and finite"),
    ("train.optim.weight_decay", "nan", "train.optim.weight_decay must be >= 0 and finite"),
    ("train.optim.weight_decay", "inf", "train.optim.weight_decay must be >= 0 and finite"),
    ("train.optim.warmup_steps", "-1", "train.optim.warmup_steps must be >= 0"),
    ("train.optim.min_lr_ratio", "nan", "train.optim.min_lr_ratio must be in [0, 1]"),
    ("train.optim.min_lr_ratio", "-0.5", "train.optim.min_lr_ratio must be in [0, 1]"),
    # train.checkpoint
    ("train.checkpoint.interval", "0", "train.checkpoint.interval must be >= 1"),
    ("train.checkpoint.keep", "0", "train.checkpoint.keep must be >= 1"),
    ("train.checkpoint.keep", "-1", "train.checkpoint.keep must be >= 1"),
    ("train.checkpoint.keep_every", "-1", "train.checkpoint.keep_every must be >= 0"),
    # train.sft
    ("train.sft.num_steps", "-1", "train.sft.num_steps must be >= 0 (0 skips the warm-up)"),
    ("train.sft.batch_size", "0", "train.sft.batch_size must be >= 1"),
    ("train.sft.lr", "0", "train.sft.lr must be > 0 and finite"),
    ("train.sft.lr", "nan", "train.sft.lr must be > 0 and finite"),
    ("train.sft.lr", "inf", "train.sft.lr must be > 0 and finite"),
    ("train.sft.warmup_steps", "-1", "train.sft.warmup_steps must be >= 0"),
    # train
    ("train.num_threads", "-1", "train.num_threads (--threads) must be in [0, 65536]"),
    ("train.logprob_chunk_tokens", "0", "train.logprob_chunk_tokens must be >= 1"),
    ("train.pub_port", "99999", "train.pub_port must be in [0, 65535]"),
    ("train.pub_port", "-1", "train.pub_port must be in [0, 65535]"),
    ("train.wait_timeout_s", "-1", "train.wait_timeout_s must be >= 0 (0 waits forever)"),
    ("train.wait_timeout_s", "nan", "train.wait_timeout_s must be >= 0"),
    # infer
    ("infer.engine.num_threads", "-1", "infer.engine.num_threads (--threads) must be in [0, 65536]"),
    ("infer.engine.kv_cache_memory_mb", "nan", "infer.engine.kv_cache_memory_mb must be > 0 and finite"),
    ("infer.engine.kv_cache_memory_mb", "inf", "infer.engine.kv_cache_memory_mb must be > 0 and finite"),
    ("infer.kv_cache.publish_queue_mb", "nan", "infer.kv_cache.publish_queue_mb must be > 0"),
    ("infer.kv_cache.timeout_s", "nan", "infer.kv_cache.timeout_s must be > 0"),
    ("infer.metrics_interval_s", "-1", "infer.metrics_interval_s must be >= 0 (0 turns it off)"),
    ("infer.metrics_interval_s", "nan", "infer.metrics_interval_s must be >= 0"),
    # orchestrate
    ("orchestrate.sampling.temperature", "nan", "orchestrate.sampling.temperature must be > 0 and finite"),
    ("orchestrate.sampling.temperature", "inf", "orchestrate.sampling.temperature must be > 0 and finite"),
    ("orchestrate.sampling.temperature", "-1", "orchestrate.sampling.temperature must be > 0 and finite"),
    ("orchestrate.sampling.top_p", "nan", "orchestrate.sampling.top_p must be in (0, 1]"),
    ("orchestrate.sampling.top_p", "0", "orchestrate.sampling.top_p must be in (0, 1]"),
    ("orchestrate.sampling.max_tokens", "0", "orchestrate.sampling.max_tokens must be >= 1"),
    ("orchestrate.advantage.max_zero_variance_drops", "-2", "orchestrate.advantage.max_zero_variance_drops must be"),
    ("orchestrate.advantage.overlong_buffer", "-1", "orchestrate.advantage.overlong_buffer must be >= 0"),
    ("orchestrate.advantage.overlong_penalty", "nan", "orchestrate.advantage.overlong_penalty must be >= 0"),
    ("orchestrate.request_timeout_s", "0", "orchestrate.request_timeout_s must be > 0"),
    ("orchestrate.request_timeout_s", "nan", "orchestrate.request_timeout_s must be > 0"),
    ("orchestrate.keep_rollouts", "-1", "orchestrate.keep_rollouts must be >= 0"),
    ("orchestrate.num_train_ranks", "0", "orchestrate.num_train_ranks must be >= 1"),
    ("orchestrate.eval.threshold", "nan", "orchestrate.eval.threshold must be a finite reward"),
    ("orchestrate.eval.top_p", "1.5", "orchestrate.eval.top_p must be in (0, 1]"),
    # sync
    ("sync.keep_weights", "0", "sync.keep_weights (--keep-weights) must be >= 1"),
    ("sync.keep_weights", "-1", "sync.keep_weights (--keep-weights) must be >= 1"),
    ("sync.keep_weights_every", "-1", "sync.keep_weights_every must be >= 0"),
    ("sync.poll_interval_s", "0", "sync.poll_interval_s must be > 0 and finite"),
    ("sync.poll_interval_s", "nan", "sync.poll_interval_s must be > 0 and finite"),
    ("sync.poll_interval_s", "inf", "sync.poll_interval_s must be > 0 and finite"),
    ("sync.ack_timeout_s", "0", "sync.ack_timeout_s must be > 0 and finite"),
    ("sync.ack_timeout_s", "nan", "sync.ack_timeout_s must be > 0 and finite"),
    ("sync.ack_timeout_s", "inf", "sync.ack_timeout_s must be > 0 and finite"),
    # cache
    ("cache.port", "99999", "cache.port must be in [0, 65535], got 99999"),
    ("cache.port", "-1", "cache.port must be in [0, 65535], got -1"),
    ("cache.capacity_mb", "0", "cache.capacity_mb must be >= 1"),
    ("cache.metrics_interval_s", "-1", "cache.metrics_interval_s must be >= 0 (0 turns it off)"),
])
def test_numeric_values_out_of_range_are_refused_naming_the_key(key, value, expected):
    with pytest.raises(ConfigError) as e:
        load_recipe(REVERSE, {}, parse_overrides([f"--{key}", value]))
    message = str(e.value)
    assert expected in message and key in message
    assert "\n" not in message
    assert message.count(key) == 1  # named once: "train.optim: train.optim.lr ..." repeated it


def test_vllm_kv_cache_space_must_be_finite():
    with pytest.raises(ConfigError, match=r"infer\.engine\.cpu_kvcache_space_gb must be > 0 and finite, got nan"):
        load_recipe(REVERSE, {}, parse_overrides(["--infer.engine.name", "vllm", "--infer.engine.cpu_kvcache_space_gb",
                                                  "nan"]))


@pytest.mark.parametrize("overrides", [
    ["--train.optim.max_grad_norm", "0"],  # clipping off
    ["--train.optim.max_grad_norm", "inf"],  # never clips
    ["--train.optim.beta1", "0"],
    ["--train.optim.weight_decay", "0.1"],
    ["--train.sft.num_steps", "0"],  # no warm-up
    ["--train.num_threads", "0", "--infer.engine.num_threads", "0"],  # torch's default / every core
    ["--train.wait_timeout_s", "0"],  # waits forever
    ["--infer.metrics_interval_s", "0", "--cache.metrics_interval_s", "0"],  # off
    ["--orchestrate.keep_rollouts", "0", "--orchestrate.advantage.max_zero_variance_drops", "-1"],
    ["--sync.keep_weights", "1"],
    ["--cache.port", "65535", "--train.pub_port", "65535"],
    ["--train.checkpoint.interval", "1", "--train.checkpoint.keep", "1"],
])
def test_boundary_values_are_accepted(overrides):
    load_recipe(REVERSE, {}, parse_overrides(overrides))


def test_defaults_pass_the_value_checks():
    from rlcli.config.services import CacheConfig, SyncConfig
    from rlcli.config.train import CheckpointConfig, OptimConfig, SFTConfig

    for cls in (OptimConfig, SFTConfig, CheckpointConfig, SyncConfig, CacheConfig, RecipeConfig):
        cls()
    load_recipe(None)


def test_direct_construction_runs_the_same_checks():
    from rlcli.config.services import SyncConfig
    from rlcli.config.train import CheckpointConfig, OptimConfig

    with pytest.raises(ValueError, match=r"train\.optim\.max_grad_norm must be >= 0"):
        OptimConfig(max_grad_norm=-1.0)
    with pytest.raises(ValueError, match=r"train\.checkpoint\.interval must be >= 1"):
        CheckpointConfig(interval=0)
    with pytest.raises(ValueError, match=r"sync\.keep_weights \(--keep-weights\) must be >= 1"):
        SyncConfig(keep_weights=0)
