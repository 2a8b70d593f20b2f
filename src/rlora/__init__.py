"""rlora: reinforcement learning of language models with LoRA adapters on one frozen base model."""

__version__ = "0.1.0"
