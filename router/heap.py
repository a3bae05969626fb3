"""The router process's start-up heap, kept out of the garbage collector's full passes."""

import gc


def freeze_startup_heap() -> None:
    """Called once start-up is done. What start-up made (modules, the app, the tokenizer's
    Python side, the metrics) lives as long as the process, yet a full collection would walk
    all of it again each time the requests' own objects trigger one, inside whichever request
    it lands in: frozen, a full pass walks only what was made since."""
    gc.collect()
    gc.freeze()
