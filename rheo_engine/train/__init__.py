"""Training: the default target (``python -m rheo_engine.train.target``), EAGLE-3 heads
(``python -m rheo_engine.train.head``) and both in one command (``rheo_engine.train.default``)."""
