"""The ``kvtier`` command: argument parsing (click) and rendering of results only; every command
calls into its package (:mod:`kvtier.launch`, :mod:`kvtier.planning`, :mod:`kvtier.doctor`,
:mod:`kvtier.cachetools`, :mod:`kvtier.bench`, :mod:`kvtier.models`). Never imported by them.
"""
