"""Webhook secrets sealed at rest: stored encrypted (Fernet: AES-128-CBC + HMAC-SHA256), opened only where webhooks
are signed or a new secret is shown once.

The keys come from `TASKGATE_SECRETS_KEYS` (a Secret: Fernet keys, newest first; the first seals, every one opens, so
keys rotate by prepending a new one and running `taskgate-keys seal-secrets`); without them, one key derived from the
API-key pepper (HKDF-SHA256), which every process that handles secrets holds already. A value stored before sealing
existed (no prefix) is read as it is until `taskgate-keys seal-secrets` seals it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from taskgate.config import CommonSettings

PREFIX = "sealed:v1:"


class SealedSecretUnreadable(Exception):
    """A sealed value none of the configured keys opens (a key was dropped too early, or the value was altered)."""


def key_from_pepper(pepper: str) -> bytes:
    """The Fernet key derived from the API-key pepper (for deployments that set no TASKGATE_SECRETS_KEYS)."""
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"taskgate webhook secrets").derive(
        pepper.encode()
    )
    return base64.urlsafe_b64encode(derived)


class Sealer:
    """Seals and opens stored secrets with one set of keys."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a sealer needs at least one key")
        self._fernet = MultiFernet([Fernet(k) for k in keys])

    @classmethod
    def of(cls, settings: CommonSettings) -> Sealer:
        """The sealer `settings` configure: TASKGATE_SECRETS_KEYS, else the pepper's derived key."""
        keys = [k.get_secret_value().encode() for k in settings.secrets_keys]
        return cls(keys or [key_from_pepper(settings.api_key_pepper)])

    @classmethod
    def from_pepper(cls, pepper: str) -> Sealer:
        """The default sealer of a deployment whose pepper is `pepper`."""
        return cls([key_from_pepper(pepper)])

    def seal(self, plain: str) -> str:
        """The value to store for `plain`."""
        return PREFIX + self._fernet.encrypt(plain.encode()).decode()

    def open(self, stored: str) -> str:
        """The secret a stored value holds (a value from before sealing is returned as it is)."""
        if not stored.startswith(PREFIX):
            return stored
        try:
            return self._fernet.decrypt(stored[len(PREFIX) :].encode()).decode()
        except InvalidToken:
            raise SealedSecretUnreadable("no configured key opens this sealed secret") from None

    def reseal(self, stored: str) -> str:
        """`stored` sealed with the newest key (a plain value sealed, an older key's value re-encrypted)."""
        if not stored.startswith(PREFIX):
            return self.seal(stored)
        try:
            return PREFIX + self._fernet.rotate(stored[len(PREFIX) :].encode()).decode()
        except InvalidToken:
            raise SealedSecretUnreadable("no configured key opens this sealed secret") from None
