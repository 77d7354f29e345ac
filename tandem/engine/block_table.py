"""The runner's block tables: one persistent int32 row per request, written as its blocks are added.

Rebuilding every scheduled request's table every step costs Python time in proportion to its
context (a 1,024-token request holds 64 blocks); here a step writes only the ids added since the
last one (one per block_size tokens for a decoding stream) and takes the step's tables with one
numpy gather. A row mirrors the KV manager's live id list (KVCacheManager.block_ids); a request
freed and allocated again gets a new list, which the row notices and rewrites.
"""

from __future__ import annotations

import numpy as np

from tandem.engine.step import ScheduledRequest


class BlockTables:
    def __init__(self, rows: int = 64, blocks: int = 64) -> None:
        self.table = np.zeros((rows, blocks), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._row: dict[str, int] = {}
        self._source: list[list[int] | None] = [None] * rows  # the id list each row mirrors
        self._free = list(range(rows - 1, -1, -1))

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self._source[row] = None
                self._free.append(row)

    def gather(self, items: list[ScheduledRequest]) -> np.ndarray:
        """The step's block tables, [len(items), the longest table], row i for items[i]."""
        rows = np.fromiter((self._sync(s.request.request_id, s.block_ids) for s in items), dtype=np.int64,
                           count=len(items))
        width = int(self.lengths[rows].max()) if len(rows) else 0
        return self.table[rows, :width]

    def _sync(self, rid: str, ids: list[int]) -> int:
        row = self._row.get(rid)
        if row is None:
            row = self._row[rid] = self._take_row()
        if self._source[row] is not ids:  # new here, or freed and allocated again since
            self._source[row] = ids
            self.table[row] = 0  # past a table's end reads as block 0, as a table built afresh would
            self.lengths[row] = 0
        known, n = int(self.lengths[row]), len(ids)
        if n != known:
            if n > self.table.shape[1]:
                self._grow(blocks=max(n, 2 * self.table.shape[1]))
            self.table[row, known:n] = ids[known:n]
            self.lengths[row] = n
        return row

    def _take_row(self) -> int:
        if not self._free:
            self._grow(rows=2 * self.table.shape[0])
        return self._free.pop()

    def _grow(self, rows: int | None = None, blocks: int | None = None) -> None:
        old_rows, old_blocks = self.table.shape
        rows, blocks = rows or old_rows, blocks or old_blocks
        table = np.zeros((rows, blocks), dtype=np.int32)
        table[:old_rows, :old_blocks] = self.table
        self.table = table
        self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, dtype=np.int64)])
        self._source += [None] * (rows - old_rows)
        self._free += list(range(rows - 1, old_rows - 1, -1))
