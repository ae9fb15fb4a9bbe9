"""Transport implementations and their lazy registry.

``TRANSPORT_CLASSES`` maps a transport name to ``"module:Class"``; a module is
imported only when the config enables its transport, so optional transports
(``gds`` needs kvikio, ``rdma`` pyverbs) cost nothing where they are not used.
A missing module or class makes :func:`load_transport_class` return None with
the reason; the engine logs it once and skips that transport.
"""

from __future__ import annotations

import importlib
import logging

from kvpool.transfer.transports.base import Transport

__all__ = ["TRANSPORT_CLASSES", "load_transport_class", "register_transport_class"]

log = logging.getLogger(__name__)

TRANSPORT_CLASSES: dict[str, str] = {
    "shm": "kvpool.transfer.transports.shm:ShmTransport",
    "tcp": "kvpool.transfer.transports.tcp:TcpTransport",
    "posix": "kvpool.transfer.transports.posix:PosixTransport",
    "gds": "kvpool.transfer.transports.gds:GdsTransport",
    "rdma": "kvpool.transfer.transports.rdma:RdmaTransport",
}


def register_transport_class(name: str, target: str) -> None:
    """Map ``name`` to ``"module:Class"`` (a Transport subclass)."""
    if ":" not in target:
        raise ValueError(f"expected 'module:Class', got {target!r}")
    TRANSPORT_CLASSES[name] = target


def load_transport_class(name: str) -> tuple[type[Transport] | None, str]:
    """Import the class registered for ``name``: (cls, "") or (None, reason)."""
    target = TRANSPORT_CLASSES.get(name)
    if target is None:
        return None, f"no transport named {name!r}"
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return None, f"module {module_name} not importable: {exc}"
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        return None, f"{target} is not a Transport subclass"
    return cls, ""
