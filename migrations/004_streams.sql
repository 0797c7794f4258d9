-- Live streams of task events.
--
-- An event keeps the error its change set (a failure, the reason of a
-- retry), so a stream or a history shows why without reading the task.
-- Events written before this migration have none.
ALTER TABLE task_events ADD COLUMN error text;
