"""The worker wing: the connector's half that runs in each vLLM worker process (one per rank).

``side`` (:class:`WorkerSide`, what the facade's worker-role methods call) registers the KV caches and
runs each step's jobs: ``load_pipeline`` / ``save_pipeline`` (the background loads and saves),
``layerwise`` (loads overlapped with the forward, ``load_mode: layerwise``), ``ownership`` (who may write a
page or a staging buffer while a late store call may still land), ``outbox`` (results back to the
scheduler), ``context`` (what the pipelines share), ``load_probe`` and ``tenant_metrics``.

It imports the shared modules of :mod:`hybridkv.connector` and the data-path wing (which moves the bytes),
never the scheduler wing: what it learns from the scheduler arrives in the step's metadata.
"""
