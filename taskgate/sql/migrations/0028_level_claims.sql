-- Issue 24: a queue that tells a backlog from a loss. Each level's latest claim: a model whose queue moves (a claim
-- within its queue timeout, or a task running) holds a backlog, never a loss, and its QUEUED tasks do not time out.
ALTER TABLE fair_level ADD COLUMN claimed_at timestamptz;
