"""The settings of ``kvpool demo`` (its flags are generated from them)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.core.config import ConfigError, setting

__all__ = ["DemoConfig"]


@dataclass
class DemoConfig:
    """The demo's workload and pool; :meth:`validate` refuses impossible mixes."""

    requests: int = setting(60, help="requests (prompts) to run")
    hit_rate: float = setting(
        0.5, help="probability a request continues an earlier prompt (0..1)")
    max_chunks: int = setting(
        4, help="new chunks per request at most (1..max_chunks per prompt)")
    min_value: int = setting(1 << 20, size=True, help="smallest value (chunk) size")
    max_value: int = setting(16 << 20, size=True, help="largest value (chunk) size")
    memory: int = setting(192 << 20, size=True, help="memory per node daemon")
    replicated_fraction: float = setting(
        0.3, flag="--replicated", help="fraction of prompts stored with 2 replicas")
    seed: int = setting(1, help="workload random seed")
    progress: bool | None = setting(
        None, help="progress bar; none = when stderr is a terminal")
    client_ttl_s: float = setting(
        2.0, cli=False,
        help="master liveness (the killed daemon's guard unmounts it at once)")
    system_chunks: int = setting(
        4, help="chunks of a shared system prompt (2 replicas, hard-pinned)")

    def validate(self) -> None:
        """Raise :class:`ConfigError` on a workload that cannot run."""
        if not (0 <= self.hit_rate <= 1 and 0 <= self.replicated_fraction <= 1):
            raise ConfigError("--hit-rate and --replicated must be within 0..1")
        if not (0 < self.min_value <= self.max_value <= self.memory) or self.requests < 1 \
                or self.max_chunks < 1:
            raise ConfigError("need 0 < min-value <= max-value <= memory, requests >= 1, "
                              "max-chunks >= 1")
