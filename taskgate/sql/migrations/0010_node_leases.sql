-- Task id node numbers (taskgate/ids.py): every process that makes ids leases one of the 1024 ten-bit node numbers,
-- so two live processes never share one. A free row has holder NULL or a lapsed expires_at; the oldest is leased
-- first, so a released number rests as long as possible before another process (maybe with another clock) takes it.
CREATE TABLE id_node_lease (
    node       smallint PRIMARY KEY CHECK (node BETWEEN 0 AND 1023),
    holder     text,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO id_node_lease (node) SELECT generate_series(0, 1023);
