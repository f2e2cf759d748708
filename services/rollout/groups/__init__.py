"""Group jobs: the scheduler that claims them, admits, generates, scores and writes each group
(`scheduler`), the group's generate path on its engine (`sampler`), and multi-turn episodes with
an environment that make a group's samples through that path (`episodes`)."""
