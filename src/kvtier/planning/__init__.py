"""``kvtier plan``'s arithmetic: a model's KV geometry and weights from its ``config.json``
(:mod:`~kvtier.planning.geometry`, :mod:`~kvtier.planning.weights`), where that config comes from
(:mod:`~kvtier.planning.model_source`) and the tier sizing (:mod:`~kvtier.planning.sizing`).
Operator side: pure Python on plain dicts, never torch or vLLM, never imported by the engine side.
"""
