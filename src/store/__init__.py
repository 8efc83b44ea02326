"""hybridkv.store."""
