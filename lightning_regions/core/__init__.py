"""Plan and apply: the snapshot of a module graph, the plan of its regions (variants,
nesting, FSDP2's sharding by the plan), the one traversal that compiles them, and what
torch did while they ran (``tracking``, ``watch``)."""
