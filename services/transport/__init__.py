"""Transports: how data moves between processes, each one module read from both ends.

A transport sits between the buffer and the processes: the sender and the receiver import it,
never each other. `weights/` is how a policy version's weights reach the engines.
"""
