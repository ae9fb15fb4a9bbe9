"""kvpool.store: the client (Put/Get with buffers, replicas, tiers), the
Mooncake-compatible class and the per-node daemon."""

__all__: list[str] = []
