"""One normalized view of a Hugging Face ``config.json`` (no torch import).

The HF dict is kept verbatim in ``hf`` and written back unchanged on save, so a
checkpoint we write loads in ``transformers`` and vLLM exactly like the one we read.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcli.errors import ModelLoadError

# model_type -> our architecture module (rlcli.models.<name>)
ARCHITECTURES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "glm_moe_dsa",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
HIDDEN_ACTS = ("silu",)
# Architectures whose attention rotates only the first ``partial_rotary_factor`` of each head.
PARTIAL_ROTARY = ("glm4_moe",)
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")


class UnsupportedConfig(ModelLoadError, ValueError):
    """A config.json field holds a value that changes the model's function in a way this code
    does not implement; refused rather than silently ignored."""


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    partial_rotary_factor: float = 1.0
    mlp_bias: bool = False
    qk_norm: bool = False
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[int] = field(default_factory=list)
    scoring_func: str = "softmax"
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # MLA (DeepSeek family)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek Sparse Attention (lightning indexer)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False
    indexer_layers: list[int] = field(default_factory=list)  # layers running their own indexer
    # tokens
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    hf: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    @property
    def is_dsa(self) -> bool:
        return self.index_topk > 0

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelArgs":
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ModelLoadError(
                f"config.json: unknown model_type {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        try:
            return _from_hf(hf)
        except KeyError as e:
            raise ModelLoadError(f"config.json ({model_type}): missing field {e.args[0]!r}") from None
        except UnsupportedConfig as e:
            raise UnsupportedConfig(f"config.json ({model_type}): {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        if not str(path):
            raise ModelLoadError("model.path is not set; set [model] path in the recipe or pass --model.path DIR")
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {path} does not exist; check model.path")
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"{path} has no config.json; model.path must be an HF-layout model directory")
        try:
            hf = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg}: invalid JSON: {e}") from None
        return cls.from_hf(hf)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the v4 (rope_theta + rope_scaling) or v5 (rope_parameters) keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        kind = params.get("rope_type", "default")
        return theta, (None if kind == "default" else dict(params))
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(hf.get("rope_theta", 10000.0)), scaling


def _check(field_name: str, value: Any, supported: tuple) -> None:
    if value not in supported:
        raise UnsupportedConfig(f"{field_name} = {value!r} is not supported (supported: {', '.join(map(repr, supported))})")


def _partial_rotary(hf: dict[str, Any], default: float) -> float:
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return default if value is None else float(value)


def _eos(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


def _from_hf(hf: dict[str, Any]) -> ModelArgs:
    model_type = hf["model_type"]
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    args = ModelArgs(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        hf=dict(hf),
    )
    layers = range(args.num_hidden_layers)
    args.o_proj_bias = args.attention_bias and model_type != "glm4_moe"
    _check("hidden_act", hf.get("hidden_act", "silu"), HIDDEN_ACTS)
    _check("rope_type", (scaling or {}).get("rope_type", "default"), ROPE_TYPES)
    args.partial_rotary_factor = _partial_rotary(hf, 0.5 if model_type == "glm4_moe" else 1.0)
    if model_type not in PARTIAL_ROTARY:
        _check("partial_rotary_factor", args.partial_rotary_factor, (1.0,))
    if model_type == "glm4_moe":
        args.qk_norm = bool(hf.get("use_qk_norm", False))
        rot = int(args.head_dim * args.partial_rotary_factor)
        if rot <= 0 or rot % 2:
            raise UnsupportedConfig(f"partial_rotary_factor = {args.partial_rotary_factor} gives {rot} rotary dims "
                                    f"of head_dim {args.head_dim}; need an even number > 0")
    if model_type in ("qwen3", "qwen3_moe"):
        args.qk_norm = True
    if model_type == "qwen3_moe":
        args.num_experts = hf.get("num_experts") or hf["num_local_experts"]
        args.num_experts_per_tok = hf["num_experts_per_tok"]
        args.moe_intermediate_size = hf["moe_intermediate_size"]
        args.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
        step = hf.get("decoder_sparse_step", 1) or 1
        dense = set(hf.get("mlp_only_layers") or [])
        args.moe_layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
    if model_type in ("deepseek_v3", "kimi_k2", "glm4_moe", *DSA_TYPES):
        args.num_experts = hf["n_routed_experts"]
        args.num_experts_per_tok = hf["num_experts_per_tok"]
        args.moe_intermediate_size = hf["moe_intermediate_size"]
        args.norm_topk_prob = bool(hf.get("norm_topk_prob", True))
        args.scoring_func = hf.get("scoring_func", "sigmoid")
        args.n_shared_experts = hf.get("n_shared_experts") or 0
        args.routed_scaling_factor = float(hf.get("routed_scaling_factor", 1.0))
        args.n_group = hf.get("n_group") or 1
        args.topk_group = hf.get("topk_group") or 1
        first_dense = hf.get("first_k_dense_replace", 0)
        freq = hf.get("moe_layer_freq", 1) or 1
        args.moe_layers = [i for i in layers if i >= first_dense and i % freq == 0]
        if hf.get("mlp_layer_types"):
            args.moe_layers = [i for i in layers if hf["mlp_layer_types"][i] == "sparse"]
        _check("scoring_func", args.scoring_func, ("sigmoid", "softmax"))
    if model_type in ("deepseek_v3", "kimi_k2", *DSA_TYPES):
        args.q_lora_rank = hf.get("q_lora_rank")
        args.kv_lora_rank = hf["kv_lora_rank"]
        args.qk_nope_head_dim = hf["qk_nope_head_dim"]
        args.qk_rope_head_dim = hf["qk_rope_head_dim"]
        args.v_head_dim = hf["v_head_dim"]
        args.head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        args.rope_interleave = bool(hf.get("rope_interleave", True))
    if model_type in DSA_TYPES:
        _dsa(hf, args)
    return args


def _dsa(hf: dict[str, Any], args: ModelArgs) -> None:
    """DeepSeek-V3.2 / GLM-5 sparse attention fields (transformers' defaults where absent)."""
    if args.q_lora_rank is None:
        raise UnsupportedConfig("q_lora_rank = None is not supported: the DSA indexer reads the query latent")
    args.rope_interleave = True  # MLA always rotates interleaved pairs here
    args.index_topk = int(hf.get("index_topk", 2048))
    args.index_head_dim = int(hf.get("index_head_dim", 128))
    args.index_n_heads = int(hf.get("index_n_heads", 64 if args.model_type == "deepseek_v32" else 32))
    if args.index_head_dim < args.qk_rope_head_dim:
        raise UnsupportedConfig(f"index_head_dim = {args.index_head_dim} is smaller than qk_rope_head_dim")
    # DeepSeek-V3.2 rotates the indexer's rope slice as two halves, GLM-5 as interleaved pairs.
    args.index_rope_interleave = args.model_type == "glm_moe_dsa"
    layers = range(args.num_hidden_layers)
    if args.model_type == "deepseek_v32":
        args.indexer_layers = list(layers)
        return
    types = hf.get("indexer_types")
    if types is None:  # transformers' schedule: a pattern string, or every freq-th layer after an offset
        pattern = hf.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in layers]
    for t in types:
        _check("indexer_types", t, ("full", "shared"))
    if types[0] != "full":
        raise UnsupportedConfig("indexer_types[0] must be 'full': a shared layer reuses an earlier layer's top-k")
    args.indexer_layers = [i for i in layers if types[i] == "full"]
