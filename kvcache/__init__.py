"""Where KV lives and moves: the cache interface, cache implementations and byte accounting."""
