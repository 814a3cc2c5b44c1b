-- Short-lived client tokens (#35): each tenant's client-token key ids (taskgate/clienttokens.py derives the signing
-- key from the server's pepper, the tenant and the id: no secret is stored). A rotation adds an id and gives the
-- older ones valid_until (their grace); a token signed under an id past it is refused.
CREATE TABLE client_token_key (
    tenant_id   text NOT NULL REFERENCES tenant (id),
    kid         text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    valid_until timestamptz,  -- NULL: current
    PRIMARY KEY (tenant_id, kid)
);
