"""The rollout service: it takes jobs over HTTP and turns them into scored samples in the replay
buffer (docs/architecture.md). Its folders are the kinds of work it does:

* `groups/`: group jobs from `/v1/rollouts`, claimed, generated (one turn, or episodes with an
  environment), scored and written to the buffer;
* `gateway/`: the OpenAI-compatible gateway, whose sessions become groups;
* `evaluations/`: held-out prompt sets at one pinned weight version, never in the buffer;
* `clients/`: the HTTP clients of the engines, the reward service and the environments.

At this root: the process (`app`, `main`, `config`, `deps`, `service`, `metrics`, `routes/`,
`submit`), and what every kind of work shares: `intake` (what a submission must satisfy),
`segments` (generation across weight updates), `toolcalls` (tool calls in the policy's text,
used by episodes and the gateway) and `engine_updates` (moving the engines to each new policy
version). A kind's folder imports from here and from `clients/`, never from another kind's.
"""
