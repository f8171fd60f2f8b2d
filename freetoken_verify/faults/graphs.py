"""Faults in the engine's CUDA graph path (proven on a GPU: on CPU the engine never graphs)."""

from __future__ import annotations

from freetoken.engine.graphs import DecodeGraphs


def graph_stale_positions() -> None:
    """The decode graph runner stops refreshing its static positions buffer once a bucket's
    graph is captured: every replay after the first rotates the keys at the old positions."""

    fill = DecodeGraphs._fill

    def stale_fill(self, bucket, *rows):
        kept = self.positions.clone()
        fill(self, bucket, *rows)
        if bucket in self.graphs:
            self.positions.copy_(kept)

    DecodeGraphs._fill = stale_fill


GRAPH_FAULTS = {"graph-stale-positions": graph_stale_positions}
