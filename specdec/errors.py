"""User-facing errors. Each message says what went wrong and what to do; the CLI prints it
without a traceback."""


class SpecdecError(Exception):
    """Base class of every error specdec raises on bad input or a bad environment."""


class ModelNotFoundError(SpecdecError):
    """A model name, path or hub id that cannot be loaded."""


class PullError(SpecdecError):
    """Downloading or assembling a registry model failed."""


class ChecksumError(PullError):
    """An assembled model file does not have the sha256 the registry names."""


class TokenizerMismatchError(SpecdecError, ValueError):
    """Draft and target do not share a tokenizer."""


class ContextLengthError(SpecdecError, ValueError):
    """A prompt that leaves no room to generate in the model's context."""


class KernelBuildError(SpecdecError, RuntimeError):
    """A compiled kernel that a chosen precision needs could not be built on this machine."""


class GGUFError(SpecdecError, ValueError):
    """A GGUF file that cannot be read: missing, not GGUF, truncated or malformed."""
