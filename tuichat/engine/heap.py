"""The garbage collector and the long-lived objects of a loaded model (no torch here: the bench imports it)."""

from __future__ import annotations

import gc


def settle_heap() -> None:
    """After a model comes or goes. The model's, torch's and transformers' objects live as long as the
    model; left in the collector's care, every full collection walks them all with the GIL held, a few times
    in a long reply, each a stall of the engine and the screen of hundreds of milliseconds. Frozen, they are
    not walked. Unfrozen first, so that what a model left behind in reference cycles is collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
