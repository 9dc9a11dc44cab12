"""The NIXL push connector: transport, side channel, registrations, and the producer and consumer.

Data flows registration → handshake → alignment → descriptors → transfer → completion, with the pure
`disagg.worker.kv` core deciding every layout and descriptor.
"""
