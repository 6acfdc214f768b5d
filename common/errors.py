"""Typed errors. Every message names the field or file, the value, and the rule it broke."""

import contextlib
import sys
import traceback


def shown(value) -> str:
    """A client's value as an error message quotes it: one of hundreds of digits shortened."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


class DeepinferError(Exception):
    """Base class: the CLI prints these as one line and exits with code 2."""


@contextlib.contextmanager
def exit_on_error(debug: bool = False):
    """The commands' error convention: a typed error is one line on stderr and exit code 2 (debug: the traceback
    first); Ctrl-C is "interrupted" and 130."""
    try:
        yield
    except DeepinferError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


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
