"""Running requests: the engine, the decoder, requests, the scheduler and the tree policy."""
