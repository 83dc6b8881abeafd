"""``store_threshold`` admission: offload a block only once it has been offered often enough.

Same meaning as vLLM's OffloadingConnector: a block must be offered for storage
``store_threshold`` times before it is stored; values below 2 disable the filter. Offer counts
live in a bounded LRU table of ``max_tracker_size`` keys, so memory stays bounded and a block not
seen for a long time starts counting again. One thread (the orchestrator's) calls it.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.core.keys import BlockKey


class StoreAdmission:
    def __init__(self, store_threshold: int, max_tracker_size: int):
        self.threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._offers: OrderedDict[BlockKey, int] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.threshold >= 2

    def offer(self, key: BlockKey) -> bool:
        """Count one offer of ``key``; True when it may be stored now."""
        if not self.enabled:
            return True
        count = self._offers.pop(key, 0) + 1
        if count >= self.threshold:
            return True  # admitted: forget it, the tier now holds it
        self._offers[key] = count
        if len(self._offers) > self.max_tracker_size:
            self._offers.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._offers)
