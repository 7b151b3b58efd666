"""One error hierarchy for the whole library.

Every message says what went wrong *and* what to do next. Only the CLI turns these
into a red line and an exit code; library code just raises them.
"""

from __future__ import annotations


class PosExtendError(Exception):
    """Base class of every error posextend raises on bad input."""


class SourceError(PosExtendError):
    """The source checkpoint is missing, incomplete or unreadable."""


class CorruptCheckpointError(SourceError):
    """A weights file is truncated, malformed or inconsistent with its config."""


class UnsupportedArchitectureError(PosExtendError):
    """No architecture spec (and no safe fallback) knows this model type."""


class RunTimeGridError(UnsupportedArchitectureError):
    """The model adapts its learned image grid to each image on every forward: nothing on disk to resize."""


class NotLearnedPositionsError(UnsupportedArchitectureError):
    """The model's positions are not a learned absolute table (rotary, relative, ALiBi...)."""


class VerificationError(PosExtendError):
    """A written checkpoint failed its check against a twin of its own config (nothing was written)."""


class InvalidLengthError(PosExtendError):
    """The requested length is not usable (<= 0, or a shrink that was not asked for)."""


class LargeOutputError(InvalidLengthError):
    """The new position tables would be far larger than any model of this size can use (and this was not
    said to be intended); ``summary`` states the size in one sentence."""

    def __init__(self, message: str, *, summary: str = ""):
        super().__init__(message)
        self.summary = summary or message


class StrategyError(PosExtendError):
    """Unknown strategy, bad strategy parameters, or a strategy that broke its contract."""


class DestinationError(PosExtendError):
    """The destination exists, overlaps the source, or cannot be written."""


class DataError(PosExtendError):
    """Training or evaluation data is missing, empty or too short."""


class TrainingError(PosExtendError):
    """Fine-tuning cannot start or had to stop (e.g. a non-finite loss)."""
