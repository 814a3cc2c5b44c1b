"""Webhook secrets sealed at rest: the table holds ciphertext, webhooks are still signed with the secret, and keys
rotate by prepending one and re-sealing."""

from __future__ import annotations

import asyncio

import pytest
from cryptography.fernet import Fernet

from taskgate import auth, keys
from taskgate.runtime import Backends
from taskgate.sealing import PREFIX, SealedSecretUnreadable, Sealer, key_from_pepper
from taskgate.store import tenants
from tests.support.harness import settings_env

LEGACY = "whsec_an_old_plaintext_secret_0123456789"  # stored before sealing existed






async def test_the_table_holds_ciphertext_and_the_secret_opens_with_the_pepper_derived_key(backends: Backends) -> None:
    pepper = backends.settings.api_key_pepper
    _key, secret = await auth.create_key(backends.pool, pepper, "sealed-tenant")
    assert secret is not None
    [(_id, stored)] = [(i, s) for i, s in await tenants.stored_webhook_secrets(backends.pool)]
    assert stored.startswith(PREFIX) and secret not in stored
    assert await auth.webhook_secrets(backends.pool, "sealed-tenant", Sealer.from_pepper(pepper)) == [secret]
    with pytest.raises(SealedSecretUnreadable):
        await auth.webhook_secrets(backends.pool, "sealed-tenant", Sealer([Fernet.generate_key()]))


async def test_seal_secrets_seals_old_plaintext_and_moves_every_secret_to_a_new_key(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    pepper = backends.settings.api_key_pepper
    _key, first = await auth.create_key(backends.pool, pepper, "tenant-one")
    await backends.pool.execute(
        "INSERT INTO tenant (id) VALUES ('legacy');"
        f"INSERT INTO webhook_secret (tenant_id, secret) VALUES ('legacy', '{LEGACY}')"
    )
    new_key = Fernet.generate_key().decode()
    for name, value in settings_env(backends.settings).items():
        monkeypatch.setenv(name, value)
    # the new key first; the pepper's key, which sealed tenant-one's secret, still listed until the re-seal is done
    monkeypatch.setenv("TASKGATE_SECRETS_KEYS", f'["{new_key}", "{key_from_pepper(pepper).decode()}"]')
    assert await asyncio.to_thread(keys.main, ["seal-secrets"]) == 0  # the command runs its own event loop
    only_new = Sealer([new_key.encode()])
    assert await auth.webhook_secrets(backends.pool, "tenant-one", only_new) == [first]
    assert await auth.webhook_secrets(backends.pool, "legacy", only_new) == [LEGACY]
    assert all(stored.startswith(PREFIX) for _, stored in await tenants.stored_webhook_secrets(backends.pool))
