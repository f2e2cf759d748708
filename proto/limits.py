"""Bounds shared by the records and the HTTP bodies, written once. This module imports nothing,
so configs read it without loading the records (numpy)."""

MAX_GROUP_SIZE = 4096  # completions of one prompt (a job's `group_size`); a reward batch holds a group
# A sampled token's logprob is ≤ 0 in exact arithmetic; engines in bf16 can round a
# near-certain token to a hair above 0, so allow that much and no more.
MAX_LOGPROB = 1e-3
