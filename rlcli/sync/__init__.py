"""rl-sync: moves each new policy from the trainer to every inference server."""
