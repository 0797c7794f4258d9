-- A task's result is bounded: at most 1 MiB (1048576 bytes) of JSON as
-- PostgreSQL stores and answers it, which is what GET /v1/tasks/{id} and
-- the COMPLETED event of a task's stream carry. Unbounded, a handler could
-- store a result no client reads back whole: the stream's frame that
-- carries it outgrew what clients read (the conveyor CLI reads 8 MiB), and
-- `submit --wait` and `watch` failed on a task that had COMPLETED. The
-- bound is measured in the stored form because jsonb may write a value
-- longer than the worker sent it (a number such as 1e300 is written out
-- in full). The worker fails a task whose result breaks it, with that
-- reason; task.MaxResultBytes is the same bound.
--
-- NOT VALID: results stored before stay as they are, unchecked; the
-- check applies to every result stored from now on.
ALTER TABLE task_results ADD CONSTRAINT task_results_payload_size
    CHECK (octet_length(payload::text) <= 1048576) NOT VALID;
