-- Tracing (issue 15): the W3C trace context (traceparent, tracestate) of the call that submitted each task, which
-- every later span of the task continues, and of the relay span each webhook delivery continues. NULL when tracing
-- was off.
ALTER TABLE task ADD COLUMN IF NOT EXISTS trace_context jsonb;
ALTER TABLE callback_delivery ADD COLUMN IF NOT EXISTS trace_context jsonb;
-- A submission carries it to insert_tasks (functions/submit_fast_path.sql), which writes it with the row.
ALTER TYPE task_submission ADD ATTRIBUTE trace_context jsonb;
