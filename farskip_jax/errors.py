"""The project's exception types.

Every user mistake (bad config key, wrong shape in a checkpoint, missing file, empty dataset) raises a
subclass of `FarSkipError` whose message names the culprit and the fix, so no traceback is needed.
"""

import difflib
import os


class FarSkipError(Exception):
    """Base class of every error a user can cause."""


class ConfigError(FarSkipError, ValueError):
    """An invalid configuration: unknown key, wrong type, or an impossible combination."""


class CheckpointError(FarSkipError):
    """A checkpoint that cannot be read, is incomplete, or does not match the model."""


class DataError(FarSkipError):
    """Missing, empty or unreadable training/evaluation data."""


class BackendError(FarSkipError):
    """A feature requested on a platform that cannot run it (e.g. ragged all-to-all on CPU)."""


def did_you_mean(name: str, options) -> str:
    """' (did you mean 'a', 'b'?)' for the options close to `name` (for an error message), else ''."""
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def env_choice(name: str, choices: dict[str, str]) -> str:
    """The value of environment switch `name`, lower-cased; unset or empty gives the first choice.
    `choices` maps each allowed value to what it does; any other value raises one ConfigError naming
    them all."""
    value = os.environ.get(name, "").strip().lower() or next(iter(choices))
    if value not in choices:
        listed = "; ".join(f"{k!r}: {v}" for k, v in choices.items())
        raise ConfigError(f"{name}={os.environ[name]!r} is not a choice; expected one of {listed}")
    return value
