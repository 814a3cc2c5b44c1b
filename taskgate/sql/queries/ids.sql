-- Leases of the ten-bit node numbers in task ids (taskgate/ids.py, migration 0010).

-- name: id_node_lease
-- Leases the free node number that has rested longest. $1 holder, $2 lease seconds. No row when all 1024 are held.
UPDATE id_node_lease l SET holder = $1, expires_at = now() + make_interval(secs => $2)
WHERE l.node = (SELECT f.node FROM id_node_lease f WHERE f.holder IS NULL OR f.expires_at < now()
                ORDER BY f.expires_at, f.node LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING l.node;

-- name: id_node_renew
-- Extends a holder's lease. $1 node, $2 holder, $3 lease seconds. No row when another holder took the number.
UPDATE id_node_lease SET expires_at = now() + make_interval(secs => $3)
WHERE node = $1 AND holder = $2
RETURNING node;

-- name: id_node_release
-- Frees a holder's node number; it rests from now on. $1 node, $2 holder.
UPDATE id_node_lease SET holder = NULL, expires_at = now()
WHERE node = $1 AND holder = $2;
