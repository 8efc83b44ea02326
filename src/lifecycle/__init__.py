"""hybridkv.lifecycle."""
