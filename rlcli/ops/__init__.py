"""Numerics shared by the trainer and the inference engine."""
