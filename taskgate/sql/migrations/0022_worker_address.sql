-- Where a worker's WorkerControl port is reached (host:port), so operators' tools (the dashboard's Drain) can call
-- the worker itself; NULL until the worker's server is up (and for workers of older versions).
ALTER TABLE worker ADD COLUMN control_address text;
