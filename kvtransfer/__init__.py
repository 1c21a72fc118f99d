"""KV layouts (paged GQA, MLA latent, Mamba state, hybrids), pack/unpack, transports
(local, tcp, cuda_ipc, nccl), the msgpack transfer protocol, leases, and the host KV tier.
Knows nothing about HTTP or routing policy."""
