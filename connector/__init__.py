"""kvpool.connector: the vLLM KV connector."""

__all__: list[str] = []
