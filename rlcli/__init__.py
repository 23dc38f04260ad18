"""rlcli: asynchronous RL post-training of language models as five composable commands."""

__version__ = "0.1.0"
