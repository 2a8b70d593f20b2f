"""Model plumbing: the only package that imports transformers' model classes and peft."""
