"""Typed exceptions raised by leanserve. Callers catch these instead of parsing messages."""

from __future__ import annotations


class LeanserveError(Exception):
    """Base class of every error leanserve raises on purpose."""


class InvalidParameterError(LeanserveError, ValueError):
    """A request or sampling parameter is out of range or ill-typed.

    Attributes:
        param: name of the offending parameter (as the user spelled it, e.g. ``"top_p"``).
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidParameterError):
    """The prompt (plus the requested completion) is longer than the model's context, in tokens."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(param, message)


class EnvironmentSettingError(LeanserveError, ValueError):
    """An environment variable leanserve reads (e.g. ``LEANSERVE_KERNEL_ISA``) has a value it does not accept, or
    one this machine cannot honour.

    Attributes:
        variable: the variable's name.
    """

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(message)
        self.variable = variable


class ModelLoadError(LeanserveError):
    """A model file or folder cannot be read (missing, malformed, or of an unsupported architecture)."""


class UnsupportedTensorTypeError(ModelLoadError):
    """A GGUF tensor uses a quantization type leanserve cannot dequantize; the message names tensor and type."""


class UnsupportedQuantizationError(InvalidParameterError):
    """A quantization method, KV cache dtype or group size that leanserve does not implement (or not on this
    device / for this weight shape); the message lists what is supported."""


class KVCapacityError(LeanserveError):
    """A request needs more KV cache blocks than the whole pool has, so it can never be scheduled.

    Attributes:
        param: what to shorten: ``"prompt"`` when the prompt alone does not fit, else ``"max_tokens"``.
    """

    def __init__(self, message: str, param: str = "max_tokens") -> None:
        super().__init__(message)
        self.param = param


class InvalidGrammarError(InvalidParameterError):
    """A structured-output constraint (JSON schema, regex, choice, EBNF grammar, tool schema) that is invalid or
    that the grammar engine does not support; the message names the problem, ``param`` the request field."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(param, message)


class RouterConfigError(InvalidParameterError):
    """A model router definition (``--model-router``, ``--model-routers-file``, a labelled examples file) that is
    invalid; ``param`` names the field (e.g. ``"routers[1].strong_share"``, ``"examples.jsonl:3.label"``)."""
