"""Every version that keys stored results, in one place.

A digest's version changes whenever its canonical form does; results are stored under
(digest, version), so a changed form never silently reuses results of another.
"""

from __future__ import annotations

from dlbricks import _core

__all__ = [
    "LAYER_DIGEST_VERSION",
    "MODEL_DIGEST_FORM",
    "SEQUENCE_DIGEST_VERSION",
    "brick_digest_version",
    "model_digest_version",
]

#: Version of a layer's canonical form (dlbricks.digest).
LAYER_DIGEST_VERSION = 1
#: Version of a sequence's canonical form, owned by the C++ core that writes it.
SEQUENCE_DIGEST_VERSION: int = _core.SEQUENCE_DIGEST_VERSION
#: Version of the whole-model digest (dlbricks.bricks.model_digest).
MODEL_DIGEST_FORM = 1


def brick_digest_version() -> int:
    """The version that keys brick results: the sequence form and the layer form it embeds."""
    return SEQUENCE_DIGEST_VERSION * 100 + LAYER_DIGEST_VERSION


def model_digest_version() -> int:
    """The version that keys whole-model results: the model form and the layer form it embeds."""
    return MODEL_DIGEST_FORM * 100 + LAYER_DIGEST_VERSION
