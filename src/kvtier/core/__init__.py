"""The vocabulary every part of the engine side shares: no engine, no tier, no I/O.

:mod:`~kvtier.core.keys` (content addressing), :mod:`~kvtier.core.config` (the one frozen,
validated configuration), :mod:`~kvtier.core.slots` (how the host tier is cut into slots),
:mod:`~kvtier.core.stats` (counters that cross process boundaries), :mod:`~kvtier.core.residency`
(which blocks each tier holds, for KV events) and :mod:`~kvtier.core.priority` (background threads
yield the CPU). Imported by the scheduler and the worker processes alike; depends on nothing else
of kvtier.
"""
