"""Engine keys sealed under this install's SECRET_KEY: another key cannot open them, and a
rotated key still can while the old one is listed in SECRET_KEY_FALLBACKS."""

from __future__ import annotations

from typing import Any

import pytest

from serving.sealing import SealError, seal, unseal

OLD = "o" * 50
NEW = "n" * 50


def test_a_rotated_secret_key_opens_what_the_old_one_sealed_only_through_fallbacks(
        settings: Any) -> None:
    settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = OLD, []
    sealed = seal("engine-key")
    settings.SECRET_KEY = NEW
    with pytest.raises(SealError):
        unseal(sealed)
    settings.SECRET_KEY_FALLBACKS = [OLD]
    assert unseal(sealed) == "engine-key"
