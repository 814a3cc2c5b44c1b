-- Chat tasks (#34): a finished chat task's answer inline (result_text: its beginning, up to the worker's
-- result_inline_chars; result_chars: the whole answer's length, which the result store holds as text/plain), why
-- generation ended, and the tokens its input and its output took (metering). Its request (messages, generation
-- parameters, the input's token count at admission) lives in request_payload like a video's.
ALTER TABLE task ADD COLUMN result_text text,
                 ADD COLUMN result_chars bigint CHECK (result_chars >= 0),
                 ADD COLUMN finish_reason text,
                 ADD COLUMN input_tokens bigint NOT NULL DEFAULT 0 CHECK (input_tokens >= 0),
                 ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0 CHECK (output_tokens >= 0);
