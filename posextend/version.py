"""The installed package's version (the one fact every layer may import; it imports nothing of posextend)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("posextend")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"
