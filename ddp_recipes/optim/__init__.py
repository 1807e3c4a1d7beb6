"""Optimizers, learning-rate scaling and schedules, and the EMA of the weights."""
