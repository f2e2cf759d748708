"""Evaluations: a held-out prompt set generated at one pinned weight version, scored, summarized
and stored per version (`evaluator`); they never touch the replay buffer."""
