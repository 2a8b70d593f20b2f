"""Built-in YAML configs shipped with the package (the demo)."""
