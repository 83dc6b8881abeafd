"""The ``vllm serve`` command with kvtier configured: kvtier's flags -> a validated command line
(:mod:`~kvtier.launch.command`), the vLLM arguments passed through (:mod:`~kvtier.launch.serve_args`),
reading a serve line without running it (:mod:`~kvtier.launch.cmdline`, for ``kvtier doctor``) and
the module vLLM's CLI runs as (:mod:`~kvtier.launch.vllm_entry`). Used by ``kvtier serve``,
``kvtier bench`` and ``kvtier doctor``; never imports vLLM.
"""
