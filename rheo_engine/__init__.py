"""rheo-engine: lossless speculative decoding with RheoSampling over EAGLE-3 draft trees.

engine = rheo_engine.Engine.from_pretrained(target=DIR, draft=DIR)
print(engine.generate("Once upon a time", max_new_tokens=64, method="rheo").text)
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Engine", "Generation"]


def __getattr__(name: str):
    # Lazy, so that `import rheo_engine.spec.kernels` does not load the model code.
    if name in __all__:
        from rheo_engine.runtime import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'rheo_engine' has no attribute {name!r}")
