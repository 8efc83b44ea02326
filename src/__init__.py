"""hybridkv: an external prefix-cache tier for vLLM that stays correct for hybrid models.

Subsystems (imports point one way):

- ``hybridkv.lifecycle`` -- pure logic: geometry, the per-request state machine, the audit trail.
- ``hybridkv.store``     -- byte storage behind one protocol (memory, file, mooncake, faulty+).
- ``hybridkv.connector`` -- the vLLM adapter; depends on both of the above.
"""

__version__ = "0.1.0"
