"""rl-orchestrate: the RL loop (tasks, rewards, advantages, bounded off-policy batching)
and `up`, the local launcher."""
