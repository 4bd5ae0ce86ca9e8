"""Models the engine drives: the Llama target, the EAGLE-3 head, and the n-gram toy (tests)."""
