-- The tasks a type's broker queue holds: admitted, PENDING. The scheduler
-- counts them (up to its window, each pass) to decide whether the type
-- goes into fair mode. Through the index of every admitted task, or by a
-- scan of the table, that count walked past all the tasks already claimed
-- and done: a burn-down's passes grew to tens of milliseconds each, ten
-- times a second. Here a claimed task's new row has no entry at all, and
-- the entry of its old row is marked dead by the first scan that passes it.
CREATE INDEX tasks_ready ON tasks (type, next_run_at) WHERE status = 'PENDING' AND admitted;
