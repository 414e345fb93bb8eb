"""The garbage collector and the long-lived objects of a loaded model (no torch here: the bench imports it)."""

from __future__ import annotations

import gc


def settle_heap() -> None:
    """After a model comes or goes. The model's, torch's and transformers' objects live as long as the
    model; left in the collector's care, every full collection walks them all with the GIL held: 260-300 ms,
    three times in a 512-token reply in the TUI, each a stall of the engine and the screen. Frozen, 16-24 ms.
    Unfrozen first, so that what a model left behind in reference cycles is collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
