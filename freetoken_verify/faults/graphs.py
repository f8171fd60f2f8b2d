"""Faults in the engine's CUDA graph path (proven on a GPU: on CPU the engine never graphs)."""

from __future__ import annotations

from freetoken.engine.graphs import DecodeGraphs
from freetoken_verify.faults.registry import Entry, fault


@fault("graph-stale-positions",
       Entry("CUDA graph static input not refreshed", "tiny-llama", (1,), ("golden",),
             r"CUDA graph replay differs from eager decode at batch \d+: prompt \d+ "
             r"step \d+", tp1_green=False, device="cuda"))
def graph_stale_positions() -> None:
    """The decode graph runner stops refreshing the positions column of its device staging
    rows once a bucket's graph is captured: every replay after the first unpacks the old
    positions and rotates the keys at them."""

    fill = DecodeGraphs._fill

    def stale_fill(self, bucket, *rows):
        kept = self.staging[:, 1].clone()
        fill(self, bucket, *rows)
        if bucket in self.graphs:
            self.staging[:, 1].copy_(kept)

    DecodeGraphs._fill = stale_fill
