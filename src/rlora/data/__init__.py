"""Prompt data: local files through `datasets`, built-in reasoning-gym tasks, prompt rendering."""
