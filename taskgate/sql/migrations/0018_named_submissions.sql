-- Submissions travel as named columnar arrays (functions/submit_fast_path.sql), not as a positional composite: the
-- composite and the functions over it go. The rate slot is one function that takes any number of slots.
DROP FUNCTION IF EXISTS submit_tasks(task_submission[], integer);
DROP FUNCTION IF EXISTS insert_tasks(task_submission[]);
DROP FUNCTION IF EXISTS take_rate_slot(text, integer);
DROP TYPE IF EXISTS task_submission;
