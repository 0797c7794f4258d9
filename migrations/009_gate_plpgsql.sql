-- The admission gate, asked by every submit and every requeue, keeps its
-- plans. As a SQL function with subqueries it could not be inlined, and
-- PostgreSQL planned its body again on every call: six tenths of a
-- millisecond, two thirds of a submit's statement. A PL/pgSQL function
-- prepares its query once per session. Same arguments, same answer.
CREATE OR REPLACE FUNCTION conveyor_must_wait(p_org uuid, p_type text, p_job uuid, p_key text) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM task_types WHERE name = p_type AND NOT admit_directly)
        OR EXISTS (SELECT 1 FROM type_limits l WHERE l.org_id = p_org AND l.type = p_type
            AND (l.paused_at IS NOT NULL OR l.max_concurrency IS NOT NULL
                OR (p_key <> '' AND l.max_concurrency_per_key IS NOT NULL)))
        OR (p_job IS NOT NULL AND EXISTS (SELECT 1 FROM jobs j WHERE j.id = p_job
            AND (j.paused_at IS NOT NULL OR j.max_concurrency IS NOT NULL
                OR (p_key <> '' AND j.max_concurrency_per_key IS NOT NULL))));
END $$;
