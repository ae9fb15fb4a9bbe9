"""kvpool.core: the shared kernel every layer builds on.

Error codes, the master's wire protocol and its RPC client, CURVE and
capability signing, configuration loading and size parsing. It imports no
other kvpool package; connector -> store -> transfer -> core, master -> core.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvpool")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
