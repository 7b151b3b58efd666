"""The package's version (the one fact every layer may import; it imports nothing of posextend).

Written here, not read from the installed metadata: ``importlib.metadata`` takes ~50 ms to import, a good part
of ``posextend --version`` and of a resize's start-up. ``pyproject.toml`` states the same version, and
``tests/test_cli.py`` checks that the two, and the installed package's, agree.
"""

from __future__ import annotations

__version__ = "0.1.0"
