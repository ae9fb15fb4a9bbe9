"""kvpool.integrations: kvpool under engines' own storage interfaces.

- :mod:`kvpool.integrations.sglang`: an SGLang HiCache storage backend
  (``--hicache-storage-backend dynamic``; docs/sglang.md).
"""

__all__: list[str] = []
