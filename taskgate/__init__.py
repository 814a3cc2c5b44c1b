"""taskgate: an asynchronous task gateway for long-running GPU inference (the shared core)."""
