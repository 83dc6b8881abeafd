"""``kvtier plan --trace``: replay a request log through kvtier's own policy and admission code,
behind a model of vLLM's own prefix cache, and report what each tier size serves.

- :mod:`kvtier.replay.trace` -- the trace formats (OpenAI-style requests, kvtier's access log, the
  bench's saved traces), read into :class:`~kvtier.replay.trace.TraceRequest`; errors name the line.
- :mod:`kvtier.replay.tokens` -- the model's tokenizer, for traces of text prompts and messages.
- :mod:`kvtier.replay.identity` -- block identities of a request (a chain hash per block).
- :mod:`kvtier.replay.engine` -- vLLM 0.32's block pool: which prompt tokens the engine's own prefix
  cache serves.
- :mod:`kvtier.replay.exact` -- one size point replayed through the orchestrator, the host index, the
  LRU/ARC policies and ``store_threshold`` admission (:mod:`kvtier.runtime.requests` decides each
  request's hit and stores, as the connector does), with in-memory disk and remote tiers
  (:mod:`kvtier.replay.sim_tiers`).
- :mod:`kvtier.replay.stack` -- the one-pass LRU: every host size at once (stack distances).
- :mod:`kvtier.replay.curve` -- the sizes, the points, the knee, time saved; :mod:`kvtier.replay.plot`
  the PNG.

Operator side: never imported by the engine. Pure Python and numpy (the tokenizer, when a trace
needs one, comes from ``transformers``).
"""
