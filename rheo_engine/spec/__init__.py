"""The algorithm: kernel wrappers, tree growth, verification and the one step function."""
