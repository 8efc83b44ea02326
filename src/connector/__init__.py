"""hybridkv.connector."""
