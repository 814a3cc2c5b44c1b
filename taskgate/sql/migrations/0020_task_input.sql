-- Input images of image-to-video requests: one row per tenant and stored image (the object itself, a canonical PNG
-- named by its sha256, lives in the result store and may be shared by tenants who sent the same pixels).
--
-- A row is what lets a tenant name an upload in a later submission (only its own), and what retention goes by: an
-- input stays while a task of its tenant still refers to it, or while it was used within retain_inputs_seconds.
CREATE TABLE task_input (
    user_id      text        NOT NULL,
    sha256       text        NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    uri          text        NOT NULL,
    width        integer     NOT NULL CHECK (width > 0),
    height       integer     NOT NULL CHECK (height > 0),
    size_bytes   bigint      NOT NULL CHECK (size_bytes > 0),
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_used_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, sha256)
);

CREATE INDEX task_input_last_used_idx ON task_input (last_used_at);
CREATE INDEX task_input_sha256_idx ON task_input (sha256);

-- The tasks that run from an input, so retention can tell whether one still needs it.
CREATE INDEX task_input_image_idx ON task (user_id, (request_payload -> 'image' ->> 'sha256'))
    WHERE request_payload ? 'image';
