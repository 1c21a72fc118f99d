"""KV layouts, pack/unpack, transports, transfer protocol and the secondary KV tier.

Arrives with the [kv-transfer] issue. Knows nothing about HTTP or routing policy.
"""
