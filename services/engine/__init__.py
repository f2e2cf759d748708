"""The reference inference engine (`asyncrl engine`): SGLang's native HTTP API on transformers.

    main.py          entry point: settings (config.py), then torch, then uvicorn
    app.py           FastAPI routes (SGLang native API + OpenAI /v1/chat/completions)
    engine.py        InferenceEngine: validation, submission, SGLang response shapes, lifecycle;
                     the control routes below are mixed into it
    scheduler.py     continuous batching loop on one thread (admit → prefill → decode)
    model_runner.py  the model, the slot KV cache, batched prefill/decode forwards
    sampling.py      temperature / top-p / top-k / min-p sampling and the logprobs returned
    updates.py       weight updates (disk, update groups, broadcast): one at a time, time-bounded,
                     and the health they report
    lora.py          LoRA adapters: a PEFT directory read and checked, applied per row of a forward
    adapters.py      LoRA loads and unloads: which adapters are held, which requests use them,
                     when one may go (LRU)
    metrics.py       Prometheus metrics (`asyncrl_engine_…`)

Control plane: a bearer token guards every endpoint but /health and /metrics; without one the
engine listens on loopback only and refuses its control endpoints (`services/runtime/auth.py`).
Disk updates and LoRA adapters load only directories inside `weights_root`. How weights arrive (the disk layout,
the broadcast) is services/transport/weights, shared with the trainer.

Guarantees: a forward never mixes weight versions; KV computed under old weights is never
reused after an update; every response carries the `weight_version` that finished it; a
request is served by the LoRA adapter it names, or refused, and an adapter stays while a
request in flight uses it. Not
provided: streaming, n > 1, penalties, grammars, prefix caching, tensor
parallelism, sliding-window attention (all refused with a clear error, not ignored).
"""
