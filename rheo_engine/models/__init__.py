"""Models the engine can drive: the n-gram toy (tests), and later the Llama target and EAGLE-3 head."""
