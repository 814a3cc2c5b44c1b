-- taskgate schema, version 1: tasks and their history, tenants and keys, callbacks, workers.

CREATE TYPE task_status AS ENUM ('CREATED', 'QUEUED', 'PROCESSING', 'SUCCEEDED', 'FAILED', 'TIMEOUT', 'CANCELED');

-- The legal moves of the state machine; mirrors taskgate.states.LEGAL (a test keeps them equal).
CREATE TABLE task_transition (
    from_status task_status NOT NULL,
    to_status   task_status NOT NULL,
    PRIMARY KEY (from_status, to_status)
);
INSERT INTO task_transition (from_status, to_status) VALUES
    ('CREATED', 'QUEUED'), ('CREATED', 'PROCESSING'), ('CREATED', 'CANCELED'),
    ('QUEUED', 'QUEUED'), ('QUEUED', 'PROCESSING'), ('QUEUED', 'CANCELED'), ('QUEUED', 'TIMEOUT'),
    ('PROCESSING', 'PROCESSING'), ('PROCESSING', 'QUEUED'), ('PROCESSING', 'SUCCEEDED'),
    ('PROCESSING', 'FAILED'), ('PROCESSING', 'TIMEOUT'), ('PROCESSING', 'CANCELED');

CREATE TABLE tenant (
    id                 text PRIMARY KEY CHECK (id ~ '^[A-Za-z0-9_-]{1,64}$'),
    created_at         timestamptz NOT NULL DEFAULT now(),
    max_pending        integer CHECK (max_pending > 0),          -- NULL: the global setting
    submits_per_minute integer CHECK (submits_per_minute > 0)    -- NULL: the global setting
);

CREATE TABLE api_key (
    id         bigserial PRIMARY KEY,
    tenant_id  text NOT NULL REFERENCES tenant (id),
    key_hash   text NOT NULL UNIQUE,      -- HMAC-SHA256(pepper, key), hex
    prefix     text NOT NULL,             -- first characters, to recognise a key in listings
    is_admin   boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

-- Webhook signing secrets; during a rotation two are valid (the older until retired_at).
CREATE TABLE webhook_secret (
    id         bigserial PRIMARY KEY,
    tenant_id  text NOT NULL REFERENCES tenant (id),
    secret     text NOT NULL CHECK (length(secret) >= 32),
    created_at timestamptz NOT NULL DEFAULT now(),
    retired_at timestamptz
);
CREATE INDEX webhook_secret_tenant_idx ON webhook_secret (tenant_id, created_at DESC);

-- Submissions per tenant per minute, shared by every submit replica.
CREATE TABLE rate_window (
    tenant_id    text NOT NULL,
    window_start timestamptz NOT NULL,
    count        integer NOT NULL,
    PRIMARY KEY (tenant_id, window_start)
);

CREATE TABLE task (
    id                  bigint PRIMARY KEY,
    user_id             text NOT NULL,
    idempotency_key     text NOT NULL,
    idempotency_derived boolean NOT NULL DEFAULT false,
    request_hash        text NOT NULL,              -- sha256 of the canonical request
    task_type           text NOT NULL,
    model_id            text NOT NULL,
    prompt              text NOT NULL,
    request_payload     jsonb NOT NULL,             -- canonical parameters
    metadata            jsonb NOT NULL DEFAULT '{}',
    priority            smallint NOT NULL CHECK (priority IN (1, 5, 10)),
    queue_name          text NOT NULL,
    status              task_status NOT NULL DEFAULT 'CREATED',
    progress            smallint NOT NULL DEFAULT 0 CHECK (progress BETWEEN 0 AND 100),
    version             bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
    attempt             integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),   -- the fencing token
    retry_count         integer NOT NULL DEFAULT 0 CHECK (retry_count >= 0),
    max_retries         integer NOT NULL DEFAULT 3 CHECK (max_retries >= 0),
    publish_count       integer NOT NULL DEFAULT 0,  -- scheduler re-publishes in the current QUEUED spell
    worker_id           text,
    lease_expires_at    timestamptz,
    timeout_extended    boolean NOT NULL DEFAULT false,
    cancel_mode         text CHECK (cancel_mode IN ('soft', 'hard')),
    not_before          timestamptz,                -- retry backoff: do not run before
    error_code          text,
    error_msg           text,
    result_uri          text,
    result_content_type text,
    result_size         bigint,
    result_sha256       text,
    result_reused       boolean NOT NULL DEFAULT false,
    callback_url        text,
    callback_events     text[] NOT NULL DEFAULT '{}',
    callback_status     text NOT NULL DEFAULT 'NONE' CHECK (callback_status IN ('NONE', 'PENDING', 'DELIVERED', 'FAILED')),
    callback_retry      integer NOT NULL DEFAULT 0,
    last_actor          text NOT NULL DEFAULT 'submit',   -- who made the latest transition (copied to history)
    last_reason         text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    queued_at           timestamptz,
    started_at          timestamptz,
    finished_at         timestamptz,
    UNIQUE (user_id, idempotency_key),
    -- terminal states and only they carry finished_at
    CONSTRAINT task_finished_iff_terminal CHECK (
        (status IN ('SUCCEEDED', 'FAILED', 'TIMEOUT', 'CANCELED')) = (finished_at IS NOT NULL)),
    CONSTRAINT task_processing_has_lease CHECK (
        status <> 'PROCESSING' OR (worker_id IS NOT NULL AND lease_expires_at IS NOT NULL
                                   AND started_at IS NOT NULL AND attempt >= 1)),
    CONSTRAINT task_succeeded_has_result CHECK (
        status <> 'SUCCEEDED' OR (result_uri IS NOT NULL AND result_sha256 IS NOT NULL AND result_size IS NOT NULL)),
    CONSTRAINT task_failed_has_error CHECK (
        status NOT IN ('FAILED', 'TIMEOUT') OR error_code IS NOT NULL),
    CONSTRAINT task_callback_consistent CHECK ((callback_url IS NULL) = (callback_status = 'NONE'))
);
-- scanners: status + age
CREATE INDEX task_status_updated_idx ON task (status, updated_at);
-- queue position and QUEUED listings per model
CREATE INDEX task_queued_rank_idx ON task (model_id, priority DESC, queued_at, id) WHERE status = 'QUEUED';
-- lease expiry scan
CREATE INDEX task_lease_idx ON task (lease_expires_at) WHERE status = 'PROCESSING';
-- a tenant's listings and pending count
CREATE INDEX task_user_status_created_idx ON task (user_id, status, created_at DESC, id DESC);
CREATE INDEX task_user_created_idx ON task (user_id, created_at DESC, id DESC);
-- reusable outputs: identical requests
CREATE INDEX task_request_hash_idx ON task (user_id, request_hash) WHERE result_sha256 IS NOT NULL;

-- History: one row per version of a task, written by the database itself (functions/task_history.sql).
CREATE TABLE task_event (
    id            bigserial PRIMARY KEY,     -- global order; WatchTasks cursor
    task_id       bigint NOT NULL REFERENCES task (id) ON DELETE CASCADE,
    user_id       text NOT NULL,
    model_id      text NOT NULL,
    version       bigint NOT NULL,
    from_status   task_status,               -- NULL for the creation
    to_status     task_status NOT NULL,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor         text NOT NULL,
    reason        text,
    progress      smallint NOT NULL,
    attempt       integer NOT NULL,
    worker_id     text,
    error_code    text,
    error_msg     text,
    result_uri    text,
    result_size   bigint,
    result_sha256 text,
    result_content_type text,
    published_at  timestamptz,               -- set by the event relay once on JetStream
    UNIQUE (task_id, version)
);
CREATE INDEX task_event_unpublished_idx ON task_event (id) WHERE published_at IS NULL;
CREATE INDEX task_event_user_idx ON task_event (user_id, id);

-- Outputs of soft-cancelled runs, reusable by an identical later request of the same tenant.
CREATE TABLE reusable_result (
    user_id             text NOT NULL,
    request_hash        text NOT NULL,
    source_task_id      bigint NOT NULL,
    result_uri          text NOT NULL,
    result_content_type text NOT NULL,
    result_size         bigint NOT NULL,
    result_sha256       text NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, request_hash)
);

-- Tasks that exhausted their retries or were failed for good, with why.
CREATE TABLE dead_letter (
    task_id    bigint PRIMARY KEY REFERENCES task (id) ON DELETE CASCADE,
    reason     text NOT NULL,
    error_code text,
    error_msg  text,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letter_created_idx ON dead_letter (created_at DESC, task_id DESC);

-- Callback outbox: one delivery per (task event, url); retried until delivered or the schedule ends.
CREATE TABLE callback_delivery (
    id               bigserial PRIMARY KEY,
    task_id          bigint NOT NULL REFERENCES task (id) ON DELETE CASCADE,
    event_id         bigint NOT NULL REFERENCES task_event (id) ON DELETE CASCADE,
    user_id          text NOT NULL,
    webhook_id       text NOT NULL UNIQUE,    -- the same on every attempt of this delivery
    event_type       text NOT NULL,
    url              text NOT NULL,
    payload          jsonb NOT NULL,
    status           text NOT NULL DEFAULT 'PENDING' CHECK (status IN ('PENDING', 'DELIVERED', 'FAILED')),
    attempts         integer NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    lease_owner      text,
    lease_expires_at timestamptz,
    last_status_code integer,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    delivered_at     timestamptz,
    UNIQUE (event_id, url),
    CONSTRAINT callback_delivered_at CHECK ((status = 'DELIVERED') = (delivered_at IS NOT NULL))
);
CREATE INDEX callback_delivery_due_idx ON callback_delivery (status, next_attempt_at) WHERE status = 'PENDING';
CREATE INDEX callback_delivery_task_idx ON callback_delivery (task_id);

CREATE TABLE callback_attempt (
    id           bigserial PRIMARY KEY,
    delivery_id  bigint NOT NULL REFERENCES callback_delivery (id) ON DELETE CASCADE,
    attempt      integer NOT NULL,
    webhook_id   text NOT NULL,
    at           timestamptz NOT NULL DEFAULT now(),
    status_code  integer,
    latency_ms   double precision NOT NULL,
    error        text,
    UNIQUE (delivery_id, attempt)
);

-- Worker registry: one row per live (or lately live) worker process.
CREATE TABLE worker (
    id             text PRIMARY KEY,
    models         text[] NOT NULL,
    slots          integer NOT NULL CHECK (slots >= 1),
    running        integer NOT NULL DEFAULT 0,
    device         text NOT NULL,
    draining       boolean NOT NULL DEFAULT false,
    started_at     timestamptz NOT NULL DEFAULT now(),
    last_heartbeat timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX worker_heartbeat_idx ON worker (last_heartbeat);
