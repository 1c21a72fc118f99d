"""The prefill worker: an engine in prefill role that exports KV. Arrives with [cluster]."""
