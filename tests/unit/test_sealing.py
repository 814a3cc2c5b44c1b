"""Sealing without a database: sealed values open with any configured key and reseal with the newest; keys must be
Fernet keys."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from pydantic import ValidationError

from taskgate.config import Settings
from taskgate.sealing import PREFIX, SealedSecretUnreadable, Sealer


def test_sealed_values_open_with_any_configured_key_and_reseal_with_the_newest() -> None:
    old, new = Fernet.generate_key(), Fernet.generate_key()
    sealed = Sealer([old]).seal("whsec_abc")
    assert sealed.startswith(PREFIX) and "whsec_abc" not in sealed
    rotating = Sealer([new, old])
    assert rotating.open(sealed) == "whsec_abc"
    resealed = rotating.reseal(sealed)
    assert Sealer([new]).open(resealed) == "whsec_abc"
    with pytest.raises(SealedSecretUnreadable):
        Sealer([new]).open(sealed)  # the old key dropped before re-sealing
    assert Sealer([new]).open("whsec_plain") == "whsec_plain"  # stored before sealing existed


def test_secrets_keys_must_be_fernet_keys() -> None:
    with pytest.raises(ValidationError, match="Fernet key"):
        Settings(secrets_keys=["not-a-key"])  # type: ignore[list-item]
    assert len(Settings(secrets_keys=[Fernet.generate_key().decode()]).secrets_keys) == 1  # type: ignore[list-item]
