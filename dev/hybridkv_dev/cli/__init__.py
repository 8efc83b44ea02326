"""The development distribution's ``hybridkv bench ...`` commands (``hybridkv.commands`` entry points)."""
