"""kvpool.transfer: the transfer engine (batches, sub-batches, transports)."""

__all__: list[str] = []
