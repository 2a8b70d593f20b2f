"""Multi-turn environments and tools (docs/environments.md): the Environment protocol, tool calling, the built-in
and third-party environments, and the batched episode runner that turns them into a Rollout."""
