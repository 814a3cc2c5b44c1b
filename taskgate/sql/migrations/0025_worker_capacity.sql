-- A worker's devices and its fractional share of the cluster-wide cap (devices x slots per device, e.g. 1.5 for one
-- GPU): the cap is floor(sum of the live workers' capacities), so four one-GPU pods hold 6 tasks, not 4 x ceil(1.5).
-- NULL capacity (a worker of an older version): its slots count instead.
ALTER TABLE worker ADD COLUMN devices integer NOT NULL DEFAULT 0, ADD COLUMN capacity double precision;
