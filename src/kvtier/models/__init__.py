"""Models kvtier can serve with no model hub: the embedded default SmolLM2-135M-Instruct,
converted once from the GGUF file its pip package ships (:mod:`~kvtier.models.default`).
Operator side (``kvtier model``, ``serve``, ``bench``, ``plan``); never imported by the engine side.
"""
