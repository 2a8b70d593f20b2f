"""Pure math of the RL algorithms: plain tensors in, tensors out. No transformers, peft or distributed here."""
