"""Sampling completions: the Generator protocol and its implementations."""
