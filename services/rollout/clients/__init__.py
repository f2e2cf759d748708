"""HTTP clients of what the rollout service calls: the engines (SGLang's native API, `engine`),
sglang-router's worker API (`router`), the reward service (`rewards`) and environment servers
(`environments`). Each owns its retries, timeouts and the counting of what failed."""
