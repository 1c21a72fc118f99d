"""The decode worker: imports KV (tier first, then the ticket's prefill worker), decodes,
and emits token deltas (`decode.worker.DecodeWorker`, `decode.kv_loader.TransferLoader`).
Knows nothing about routing or HTTP."""
