from typing import Literal

import msgspec

from rlcli.config.base import Config


class ModelConfig(Config):
    """The policy model shared by rl-train and rl-infer."""

    path: str = ""
    """HF-layout model directory (config.json, safetensors, tokenizer). A directory with a
    config.json but no safetensors starts from random weights drawn with the recipe's seed."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the trainer and the native inference engine, and the dtype of published
    weights. The engine holds its weights in it; the trainer in bf16 steps fp32 master weights
    (FSDP2, one rank included)."""

    max_seq_len: int = 1024
    """Longest sequence (prompt + completion) in tokens that either side accepts."""

    batch_invariant: bool = False
    """Native engine and trainer give each token the same logprob bits whatever its batch (CPU, and
    CUDA through Triton kernels; GQA or dense-MLA models, dense or MoE; rlcli.ops.batch_invariant)."""

    def __post_init__(self) -> None:
        if self.max_seq_len < 8:
            raise ValueError(f"model.max_seq_len must be >= 8, got {self.max_seq_len}")


class Fp8Config(Config):
    """FP8 block-scaled GEMMs (DeepSeek-V3 recipe: 1x128 activation tiles, 128x128 weight blocks).

    Linears whose module name matches an ``include`` pattern and no ``exclude`` pattern
    (fnmatch, on names like ``model.layers.0.self_attn.q_proj``) are swapped for FP8
    linears; stacked MoE experts (``...mlp.experts``) use FP8 grouped GEMMs. Set the same
    values under ``train.fp8`` and ``infer.fp8`` so trainer and engine compute one function (a recipe
    with both on and another include, exclude or ue8m0 is refused).
    """

    enabled: bool = False
    """Run the matched GEMMs in FP8 (rl-train --fp8 / rl-infer --fp8)."""

    backend: Literal["auto", "deep_gemm", "torch", "emulated"] = "auto"
    """GEMM kernels: auto picks deep_gemm, then torch scaled_mm (SM90), then the CPU emulation."""

    include: list[str] = msgspec.field(default_factory=lambda: ["*"])
    """fnmatch patterns of module names to run in FP8."""

    exclude: list[str] = msgspec.field(
        default_factory=lambda: ["*embed_tokens", "lm_head", "*.mlp.gate", "*.indexer.weights_proj"])
    """fnmatch patterns left in high precision: by default the embeddings, the LM head, the MoE router
    and DSA's indexer head weights (``weights_proj``, unquantized in DeepSeek-V3.2's checkpoints)."""

    ue8m0: bool = False
    """Round block scales up to powers of two (UE8M0) instead of exact fp32 scales."""

    fuse_siblings: list[Literal["qkv", "gate_up"]] = msgspec.field(default_factory=lambda: ["qkv"])
    """Sibling linears run as one stacked FP8 GEMM per pass: qkv (q/k/v_proj) and/or gate_up (gate/up_proj)."""

    graph: Literal["eager", "fused"] = "eager"
    """Under train.compile, how FP8 linears meet the compiled blocks: run eagerly between graph pieces
    with cached weights and stacked siblings (eager), or traced into the graph with their quantization
    fused by inductor into the ops around it (fused; rlcli.ops.fp8.graph): no graph breaks and no
    weight cache (less memory), but on one H200 a slower step (docs/benchmarks.md). FP8 MoE experts
    always run eagerly. No effect without compilation. Trainer only."""

    jit_warmup: bool = True
    """With DeepGEMM: before the first step, compile every kernel the process's token counts can pick, in
    parallel processes (``rlcli.ops.fp8.warmup``; kept on disk in ``$DG_JIT_CACHE_DIR``)."""

    jit_warmup_tokens: list[int] = msgspec.field(default_factory=list)
    """The only token counts a micro-batch will have on one rank (under context parallelism, its share),
    where known (e.g. rows all of one length): the warm-up compiles for these instead of every count up
    to the bound. Empty: every count."""

    publish: bool = False
    """rl-train: write policy weights as FP8 + weight_scale_inv (DeepSeek-V3 layout) instead of model.dtype."""

    def __post_init__(self) -> None:
        if any(t < 1 for t in self.jit_warmup_tokens):
            raise ValueError(f"fp8.jit_warmup_tokens must be token counts >= 1, got {self.jit_warmup_tokens}")
