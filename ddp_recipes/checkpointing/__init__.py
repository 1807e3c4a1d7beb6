"""Checkpoints and resume: atomic checkpoint IO, RNG and loader state, preemption."""
