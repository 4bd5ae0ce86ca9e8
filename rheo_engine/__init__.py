"""rheo-engine: lossless speculative decoding with RheoSampling over EAGLE-3 draft trees."""

__version__ = "0.1.0"
