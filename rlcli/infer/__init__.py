"""rl-infer: the Engine interface and its factory, the native engine, the serving loop and its OpenAI-compatible HTTP API."""
