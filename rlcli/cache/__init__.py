"""rl-cache: a shared KV-block store (embedded memory tier; disk and Mooncake tiers plug in)."""
