"""Typed errors. Every message names the field or file, the value, and the rule it broke."""


class DeepinferError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


class ConfigError(DeepinferError):
    """A model config.json field is missing, malformed or unsupported."""


class CheckpointError(DeepinferError):
    """A checkpoint tensor is missing, has the wrong shape or dtype, or the files are unreadable."""


class OptionError(DeepinferError):
    """A compile or run option (flag) is invalid or inconsistent with the others."""


class ArtifactError(DeepinferError):
    """An artifact is incomplete, altered, or built for another toolchain."""


class RequestError(DeepinferError):
    """A generation request is invalid (the server answers 400)."""


class CapacityError(DeepinferError):
    """The engine cannot take the request now (the server answers 503)."""


class BackendUnavailable(DeepinferError):
    """A backend's toolchain is not installed here (e.g. the AWS Neuron SDK)."""


class RankFailure(DeepinferError):
    """A follower rank died or stopped answering."""
