"""Models kvtier can serve with no model hub, each converted once from a GGUF file a pip package
ships into a plain Hugging Face folder under ``<kvtier cache>/models``:

* :mod:`~kvtier.models.default`: the embedded default SmolLM2-135M-Instruct (Llama, full attention);
* :mod:`~kvtier.models.gemma`: Gemma 3 270M base (sliding window 512 on 15 of 18 layers; Gemma terms,
  installed only on request).

:mod:`~kvtier.models.folder` is the cache folder life cycle both share, :mod:`~kvtier.models.gguf_reader`
a fast GGUF header reader and dequantizer. Operator side (``kvtier model``, ``serve``, ``bench``, ``plan``);
never imported by the engine side.
"""
