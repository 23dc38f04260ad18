"""rl-infer: inference server (native paged engine; vLLM backend later)."""
