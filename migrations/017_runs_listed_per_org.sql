-- An org's workflow runs, newest first.
--
-- Runs are kept for ever (a minutely schedule makes half a million a
-- year), and the listing of all an org's runs had no index in its order:
-- it walked every org's runs by id, newest first, and an org whose runs
-- were older than another's read all of those at every page (or read all
-- its own and sorted them). One workflow's runs keep workflow_runs_list.
CREATE INDEX workflow_runs_org ON workflow_runs (org_id, id);
