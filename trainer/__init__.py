"""The asyncrl trainer (docs/architecture.md §6): pure losses and advantages, an FSDP2 training loop over
the Redis replay buffer, versioned weight publishing and exactly-once checkpoints.

Entry point: `asyncrl train --config FILE [--nproc-per-node N]` (trainer/main.py).
"""
