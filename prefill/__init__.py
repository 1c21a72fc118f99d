"""The prefill worker: an engine in prefill role that exports KV under leases
(`prefill.worker.PrefillWorker`). Knows nothing about routing or HTTP."""
