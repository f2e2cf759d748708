"""`asyncrl tinker`: a Tinker-compatible training API (the `tinker` SDK's routes and shapes) on
this stack's LoRA trainer and engines (docs/architecture.md §13)."""
