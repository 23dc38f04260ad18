"""rl-train: consumes rollout batches, steps the policy, writes weights and checkpoints."""
