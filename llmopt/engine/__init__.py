"""The engine: KV caches, sequences and the generation loops that drive the model."""
