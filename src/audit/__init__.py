"""hybridkv.audit: the audit wing, tools over the lifecycle's transition table and its audit trail.

- ``sinks``: ``JsonLinesAuditSink``, the production sink (the connector's ``audit_log``): the standard
  library's ``QueueHandler`` / ``QueueListener`` over a bounded queue (a slow disk never blocks the
  scheduler; overflow is dropped, counted and marked in the file), size rotation and logrotate following.
- ``replay``: ``hybridkv audit``'s checker: a log (or a rotated set, ``.gz`` siblings too) replayed against
  ``TRANSITIONS``.
- ``trace``: audit records as vLLM's proposed KV-connector lifecycle trace (``hybridkv audit --export``).
- ``diagram``: Mermaid / DOT rendered from the table (``hybridkv diagram``).

The machine itself (``hybridkv.lifecycle``) only knows ``hybridkv.lifecycle.sink.AuditSink``; nothing in
``hybridkv.lifecycle`` imports this package.
"""
