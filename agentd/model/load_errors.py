"""The errors of finding and loading a model (their messages say what to do).

Invariant: this module imports nothing, so every model module may raise these without importing
another (the loader finds the default model, which raises them too).
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be found or loaded; the message says what to do."""


class UnsupportedModelError(ModelLoadError):
    """The model's architecture is not one agentd implements."""


class GgufHeaderError(ModelLoadError):
    """A GGUF's header claims what its bytes do not hold (a count or length past the end of the
    file, a tensor where there is none, a shape its model's metadata contradicts); one line that
    names the item, what it claims and what the file holds."""
