-- Text attachments of chat tasks (#34): UploadInput stores a text (content_type 'text/plain', UTF-8) beside the input
-- images, in the same table and under the same retention (a row per tenant and sha256, deleted a while after its
-- last use). A chat message names it by sha256 and the gateway puts its text in the task's request at admission, so
-- no task needs the object once admitted. Images keep their width and height; a text has its length in characters.
ALTER TABLE task_input ADD COLUMN content_type text NOT NULL DEFAULT 'image/png'
                           CHECK (content_type IN ('image/png', 'text/plain')),
                       ADD COLUMN chars bigint CHECK (chars >= 0),
                       ALTER COLUMN width DROP NOT NULL,
                       ALTER COLUMN height DROP NOT NULL,
                       ADD CONSTRAINT task_input_kind CHECK (
                           CASE content_type WHEN 'image/png' THEN width IS NOT NULL AND height IS NOT NULL
                                             ELSE chars IS NOT NULL END);
