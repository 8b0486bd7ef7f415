"""The graph backend's test tuning (the step checks shared with the megakernel tests are in tests/backend_checks.py)."""

from __future__ import annotations


def small_tiles():
    """A tuning with 16-key tiles and 3 splits, so the tiny tests' short contexts span several tiles and splits."""
    from megakernel.graph.backend import GraphTuning

    class SmallTiles(GraphTuning):
        def attention(self, rows: int) -> dict:
            return {**super().attention(rows), "nsplit": 3, "block_t": 16}

    return SmallTiles()
