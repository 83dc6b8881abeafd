"""The host tier's slot geometry: how many bytes one block takes and how a budget is cut into slots.

One kvtier block = ``pages_per_block`` consecutive engine blocks (pages) of every layer, for one
rank. A host slot holds exactly one block of one rank, laid out layer-major::

    slot = [layer 0: page 0 | page 1 | ...][layer 1: page 0 | ...] ...

so one layer's pages of a block are contiguous and a whole slot is one contiguous piece of
``slot_bytes`` (big, contiguous transfers; see notes/peers.md lesson 5). The same slot number
names the same block in every rank's region.

Pure arithmetic, no I/O: built once at start-up by the connector in every process (scheduler and
workers derive the same layout from the same config), then read-only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostSlotLayout:
    num_layers: int
    pages_per_block: int
    page_bytes: int  # one engine block of one layer of one rank
    world_size: int
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one block of one rank: the payload of one disk file."""
        return self.num_layers * self.pages_per_block * self.page_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes of one rank's shared-memory region."""
        return self.num_slots * self.slot_bytes

    @classmethod
    def for_budget(
        cls, cpu_bytes_to_use: int, num_layers: int, pages_per_block: int, page_bytes: int, world_size: int
    ) -> "HostSlotLayout":
        """Cut ``cpu_bytes_to_use`` (total across ranks, like vLLM's flag) into whole slots.

        Raises ValueError naming the minimum when the budget does not hold one block per rank.
        """
        per_block_all_ranks = num_layers * pages_per_block * page_bytes * world_size
        num_slots = cpu_bytes_to_use // per_block_all_ranks
        if num_slots < 1:
            raise ValueError(
                f"cpu_bytes_to_use={cpu_bytes_to_use} is smaller than one KV block across all ranks "
                f"({per_block_all_ranks} bytes = {num_layers} layers x {pages_per_block} pages x "
                f"{page_bytes} B x {world_size} ranks); raise it to at least {per_block_all_ranks}"
            )
        return cls(num_layers, pages_per_block, page_bytes, world_size, num_slots)
