"""One row of the engine's shared CPU region as kvtier payloads: one per rank.

vLLM's CPU tier keeps an offloaded chunk in one row of a shared memory region::

    | rank 0's pages | rank 1's pages | ... | rank N-1's pages | padding to a memory page |

(one copy instead of N when the KV is replicated). A kvtier record holds one rank's pages, so a
row is N payloads of ``payload_bytes`` each, in rank order; the padding is never stored.

Buffers: the region is the engine's. :class:`Rows` holds a flat byte view of it and hands out
slices; the caller keeps a row pinned (vLLM does: a job's rows stay reserved until it reports).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowLayout:
    """``copies`` payloads of ``payload_bytes`` at the start of every ``row_bytes`` row."""

    num_rows: int
    row_bytes: int
    copies: int
    payload_bytes: int

    def __post_init__(self) -> None:
        if self.copies * self.payload_bytes > self.row_bytes:
            raise ValueError(
                f"a row of {self.row_bytes} bytes cannot hold {self.copies} payloads of {self.payload_bytes} "
                "bytes: the engine's offloading config and its CPU region disagree")


class Rows:
    """Byte slices of a region's rows (a C-contiguous buffer of ``num_rows x row_bytes``)."""

    def __init__(self, region: memoryview, copies: int, payload_bytes: int):
        view = memoryview(region)
        if not view.c_contiguous:
            raise ValueError("the shared region must be C-contiguous")
        num_rows = view.shape[0] if view.ndim > 1 else 1
        flat = view.cast("B") if (view.format != "B" or view.ndim != 1) else view
        if flat.nbytes % num_rows:
            raise ValueError(f"{flat.nbytes} bytes are not {num_rows} equal rows")
        self.layout = RowLayout(num_rows, flat.nbytes // num_rows, copies, payload_bytes)
        self._flat = flat

    def payloads(self, row: int) -> list[memoryview]:
        """Row ``row``'s payloads, rank order (views into the region, no copy)."""
        layout = self.layout
        if not 0 <= row < layout.num_rows:
            raise IndexError(f"row {row} out of range [0, {layout.num_rows})")
        start = row * layout.row_bytes
        size = layout.payload_bytes
        return [self._flat[start + copy * size : start + (copy + 1) * size] for copy in range(layout.copies)]

    def release(self) -> None:
        """Drop this view of the region (its owner can then unmap it); no job may be in flight."""
        self._flat.release()
