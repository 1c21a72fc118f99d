"""The decode worker: imports KV, decodes, streams tokens. Arrives with [cluster]."""
