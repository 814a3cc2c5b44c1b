-- A batch whose input a face translated (the OpenAI face: its JSONL of OpenAI requests into taskgate submissions)
-- keeps the caller's own file too, which is what the face shows as the batch's input.
ALTER TABLE task_batch ADD COLUMN source_file_id bigint REFERENCES stored_file (id);
