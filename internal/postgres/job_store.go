package postgres

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/wait"
)

// The API's statements on jobs, type limits and pauses, all in the
// caller's org scope.

const jobColumns = `id, name, definition, config_hash, paused_at, next_tick_at, created_at, updated_at`

const jobsOfOrg = `SELECT ` + jobColumns + ` FROM jobs WHERE org_id = $1 ORDER BY name`

var sqlJobsList = statement("jobs.list", jobsOfOrg)

// sqlJobsLock holds the org's jobs for an apply: two applies take turns.
var sqlJobsLock = statement("jobs.lock", jobsOfOrg+` FOR UPDATE`)

var sqlJobGet = statement("jobs.get", `SELECT `+jobColumns+` FROM jobs WHERE org_id = $1 AND name = $2`)

var sqlJobInsert = statement("jobs.insert", `
INSERT INTO jobs (org_id, name, type, payload, priority, schedule, timezone, missed, max_attempts, timeout_seconds,
	heartbeat_timeout_seconds, max_concurrency, max_concurrency_per_key, active, config_hash, definition, next_tick_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, nullif($10, 0), nullif($11, 0), nullif($12, 0), nullif($13, 0), $14, $15,
	$16, $17)`)

// sqlJobUpdate rewrites a job's definition; the schedule's cursor moves
// only when the schedule itself changed ($18).
var sqlJobUpdate = statement("jobs.update", `
UPDATE jobs SET type = $3, payload = $4, priority = $5, schedule = $6, timezone = $7, missed = $8, max_attempts = $9,
	timeout_seconds = nullif($10, 0), heartbeat_timeout_seconds = nullif($11, 0), max_concurrency = nullif($12, 0),
	max_concurrency_per_key = nullif($13, 0), active = $14, config_hash = $15, definition = $16,
	next_tick_at = CASE WHEN $18 THEN $17 ELSE next_tick_at END, updated_at = now()
WHERE org_id = $1 AND name = $2`)

var sqlJobDelete = statement("jobs.delete", `DELETE FROM jobs WHERE org_id = $1 AND name = $2`)

const typeLimitsOfOrg = `SELECT type, coalesce(max_concurrency, 0), coalesce(max_concurrency_per_key, 0), paused_at
FROM type_limits WHERE org_id = $1 ORDER BY type`

var sqlTypeLimitsList = statement("type_limits.list", typeLimitsOfOrg)

var sqlTypeLimitsLock = statement("type_limits.lock", typeLimitsOfOrg+` FOR UPDATE`)

var sqlTypeLimitSet = statement("type_limits.set", `
INSERT INTO type_limits (org_id, type, max_concurrency, max_concurrency_per_key)
VALUES ($1, $2, nullif($3, 0), nullif($4, 0))
ON CONFLICT (org_id, type) DO UPDATE SET max_concurrency = excluded.max_concurrency,
	max_concurrency_per_key = excluded.max_concurrency_per_key, updated_at = now()`)

// sqlTypeLimitUnset removes a type's limits; sqlTypeLimitDrop then drops
// the row unless the type is paused.
var sqlTypeLimitUnset = statement("type_limits.unset", `
UPDATE type_limits SET max_concurrency = NULL, max_concurrency_per_key = NULL, updated_at = now()
WHERE org_id = $1 AND type = $2`)

var sqlTypeLimitDrop = statement("type_limits.drop", `
DELETE FROM type_limits WHERE org_id = $1 AND type = $2
	AND paused_at IS NULL AND max_concurrency IS NULL AND max_concurrency_per_key IS NULL`)

var sqlJobPause = statement("jobs.pause", `
UPDATE jobs SET paused_at = CASE WHEN $3 THEN coalesce(paused_at, now()) END, updated_at = now()
WHERE org_id = $1 AND name = $2 RETURNING id`)

// sqlJobResumeState reads, and locks until the resume commits, what a
// resume needs to move the schedule's cursor past the ticks of the pause.
var sqlJobResumeState = statement("jobs.resume_state", `
SELECT schedule, timezone, missed, next_tick_at, paused_at IS NOT NULL FROM jobs
WHERE org_id = $1 AND name = $2 FOR UPDATE`)

var sqlTypePause = statement("type_limits.pause", `
INSERT INTO type_limits (org_id, type, paused_at) VALUES ($1, $2, now())
ON CONFLICT (org_id, type) DO UPDATE SET paused_at = coalesce(type_limits.paused_at, now()), updated_at = now()`)

var sqlTypeResume = statement("type_limits.resume", `
UPDATE type_limits SET paused_at = NULL, updated_at = now() WHERE org_id = $1 AND type = $2`)

// sqlWithdraw takes back the admission of the PENDING tasks of the job
// named $2 (or, with a NULL job, of the type $3), just paused or given a
// tighter limit: they wait again. A message of theirs already in the
// broker finds them not admitted and is dropped.
var sqlWithdraw = statement("tasks.withdraw", `
UPDATE tasks SET admitted = false, state = '`+task.StateWaiting+`', updated_at = now()
WHERE org_id = $1 AND `+isPending+` AND admitted
	AND (($2::text IS NOT NULL AND job_id = (SELECT id FROM jobs WHERE org_id = $1 AND name = $2))
		OR ($2::text IS NULL AND type = $3))`)

// limitsTightened reports whether a limit (total or per key; 0 is none)
// was set or lowered.
func limitsTightened(oldTotal, oldPerKey, total, perKey int) bool {
	tighter := func(old, cur int) bool { return cur > 0 && (old == 0 || cur < old) }
	return tighter(oldTotal, total) || tighter(oldPerKey, perKey)
}

// sqlWaitForAdmission waits for a running admission pass to end and keeps
// the next one from starting until the transaction ends: a pass that
// picked tasks before a pause (or a new limit) would admit them after it.
var sqlWaitForAdmission = statement("scheduler.wait", `SELECT pg_advisory_xact_lock(`+fmt.Sprint(schedulerLock)+`)`)

// sqlSessionUser makes the rest of the transaction run as the session's
// own user, not the tenant role a pool's connections may take: only the
// user's own sessions show their transactions in pg_stat_activity.
var sqlSessionUser = statement("sessions.user", `SELECT set_config('role', 'none', true)`)

// sqlOlderTransactions says whether another session of the database is in
// a transaction begun before $1 (NULL: now, which it returns as the moment
// to ask about next time). Those the caller cannot see (another user's,
// without the right to read their activity) show no start and are not
// waited for.
var sqlOlderTransactions = statement("sessions.older_transactions", `
SELECT since, EXISTS (SELECT 1 FROM pg_stat_activity
	WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
		AND xact_start < since)
FROM (SELECT coalesce($1::timestamptz, clock_timestamp()) AS since) s`)

// settleWait bounds how long a pause or a tighter limit waits for the
// transactions that began before it to end.
const settleWait = 2 * time.Second

// withdrawal names whose admitted tasks a pause or a tighter limit took
// back: a job, or (with no job) a type.
type withdrawal struct{ job, typ *string }

// settle takes back again the admissions ws took back, once the
// transactions that began before they committed have ended (or after
// settleWait). A submission decides whether its task waits from what its
// statement read as it began: one that began before a pause committed
// admits its task as if there were none, and commits it after the pause's
// own withdrawal. Once settle returns, no such task is left admitted, so
// no task of a paused job or type starts after the pause has answered.
func (s *JobStore) settle(ctx context.Context, p auth.Principal, ws []withdrawal) error {
	if len(ws) == 0 {
		return nil
	}
	// The first ask takes the moment, after the change's commit.
	var since *time.Time
	deadline := time.Now().Add(settleWait)
	for {
		b := &pgx.Batch{}
		b.Queue(sqlSessionUser)
		b.Queue(sqlOlderTransactions, since)
		var older bool
		if err := (batchRow{s.pool.SendBatch(ctx, b)}).Scan(&since, &older); err != nil {
			return translate(err)
		}
		if !older || time.Now().After(deadline) {
			break
		}
		if !wait.Sleep(ctx, 5*time.Millisecond) {
			return ctx.Err()
		}
	}
	return translate(inScope(ctx, s.pool, orgWide(p), func(tx pgx.Tx) error {
		for _, w := range ws {
			if _, err := tx.Exec(ctx, sqlWithdraw, p.OrgID, w.job, w.typ); err != nil {
				return err
			}
		}
		return nil
	}))
}

// JobStore runs the API's statements on jobs and type limits.
type JobStore struct {
	pool *pgxpool.Pool
	// OnChange, when set, is called after a commit that may let waiting
	// tasks be admitted or made tasks (the scheduler's wake-up).
	OnChange func()
	// OnOutbox, when set, is called after a commit that wrote outbox
	// messages.
	OnOutbox func()
	// OnEvents, when set, is called after a commit that appended task
	// events.
	OnEvents func()
}

// NewJobStore returns the API's job store.
func NewJobStore(pool *pgxpool.Pool) *JobStore { return &JobStore{pool: pool} }

// Jobs lists the org's jobs.
func (s *JobStore) Jobs(ctx context.Context, p auth.Principal) ([]job.Stored, error) {
	out, err := scopedRows(ctx, s.pool, p.Scope(), scanJob, sqlJobsList, p.OrgID)
	return out, translate(err)
}

// Job returns one job of the org by name, or a not-found error naming it.
func (s *JobStore) Job(ctx context.Context, p auth.Principal, name string) (job.Stored, error) {
	if task.ValidateType(name) != nil {
		// No job has a name of another form (nor one PostgreSQL refuses).
		return job.Stored{}, missing("job", name)
	}
	out, err := scopedRows(ctx, s.pool, p.Scope(), scanJob, sqlJobGet, p.OrgID, name)
	if err != nil {
		return job.Stored{}, translate(err)
	}
	if len(out) == 0 {
		return job.Stored{}, missing("job", name)
	}
	return out[0], nil
}

// TypeLimits lists the org's type limits and pauses.
func (s *JobStore) TypeLimits(ctx context.Context, p auth.Principal) ([]job.TypeState, error) {
	out, err := scopedRows(ctx, s.pool, p.Scope(), scanTypeState, sqlTypeLimitsList, p.OrgID)
	return out, translate(err)
}

func scanJob(row pgx.CollectableRow) (job.Stored, error) {
	var j job.Stored
	var def []byte
	if err := row.Scan(&j.ID, &j.Name, &def, &j.ConfigHash, &j.PausedAt, &j.NextTickAt, &j.CreatedAt, &j.UpdatedAt); err != nil {
		return job.Stored{}, err
	}
	if err := json.Unmarshal(def, &j.Definition); err != nil {
		return job.Stored{}, fmt.Errorf("job %s: stored definition: %w", j.Name, err)
	}
	return j, nil
}

func scanTypeState(row pgx.CollectableRow) (job.TypeState, error) {
	var t job.TypeState
	err := row.Scan(&t.Type, &t.MaxConcurrency, &t.MaxConcurrencyPerKey, &t.PausedAt)
	return t, err
}

// Apply brings the org's jobs and type limits to file, in one transaction
// that holds the org's job rows, and returns the changes; with dryRun it
// changes nothing. Jobs and limits the file leaves out are removed only
// with prune.
func (s *JobStore) Apply(ctx context.Context, p auth.Principal, file job.File, dryRun, prune bool) ([]job.Change, error) {
	var changes []job.Change
	var withdrawn []withdrawal
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		if !dryRun {
			if _, err := tx.Exec(ctx, sqlWaitForAdmission); err != nil {
				return err
			}
		}
		rows, err := tx.Query(ctx, sqlJobsLock, p.OrgID)
		if err != nil {
			return err
		}
		jobs, err := pgx.CollectRows(rows, scanJob)
		if err != nil {
			return err
		}
		rows, err = tx.Query(ctx, sqlTypeLimitsLock, p.OrgID)
		if err != nil {
			return err
		}
		types, err := pgx.CollectRows(rows, scanTypeState)
		if err != nil {
			return err
		}
		rows, err = tx.Query(ctx, sqlWorkflowsLock, p.OrgID)
		if err != nil {
			return err
		}
		workflows, err := pgx.CollectRows(rows, scanWorkflow)
		if err != nil {
			return err
		}
		var current job.File
		storedFlows := map[string]job.Workflow{}
		for _, w := range workflows {
			current.Workflows = append(current.Workflows, w.Definition)
			storedFlows[w.Definition.Name] = w.Definition
		}
		declared := map[string]job.Definition{}
		for _, d := range file.Jobs {
			declared[d.Name] = d
		}
		stored := map[string]job.Definition{}
		for _, j := range jobs {
			d := j.Definition
			// The stored definition went through jsonb, which writes some
			// payload numbers otherwise (1e-7 as 0.0000001): a job whose
			// config_hash is that of its declaration is that declaration.
			if w, ok := declared[j.Name]; ok && w.Hash() == j.ConfigHash {
				d = w
			}
			current.Jobs = append(current.Jobs, d)
			stored[j.Name] = d
		}
		storedTypes := map[string]job.TypeLimit{}
		for _, t := range types {
			storedTypes[t.Type] = t.TypeLimit
			if t.MaxConcurrency > 0 || t.MaxConcurrencyPerKey > 0 {
				current.Types = append(current.Types, t.TypeLimit)
			}
		}
		// An entry without limits asks for none: nothing to do for a type
		// that has none.
		want := file
		want.Types = nil
		limited := map[string]bool{}
		for _, t := range current.Types {
			limited[t.Type] = true
		}
		for _, t := range file.Types {
			if t.MaxConcurrency > 0 || t.MaxConcurrencyPerKey > 0 || limited[t.Type] {
				want.Types = append(want.Types, t)
			}
		}
		changes = job.Diff(current, want, prune)
		if dryRun {
			return nil
		}
		desired := map[string]job.Definition{}
		for _, d := range file.Jobs {
			desired[d.Name] = d.Normalized()
		}
		flows := map[string]job.Workflow{}
		for _, w := range file.Workflows {
			flows[w.Name] = w.Normalized()
		}
		limits := map[string]job.TypeLimit{}
		for _, t := range file.Types {
			limits[t.Type] = t
		}
		now := time.Now()
		for _, c := range changes {
			var err error
			switch {
			case c.Kind == job.KindJob && c.Op == job.OpCreate:
				err = writeJob(ctx, tx, p.OrgID, desired[c.Name], nil, now)
			case c.Kind == job.KindJob && c.Op == job.OpUpdate:
				old := stored[c.Name]
				d := desired[c.Name]
				err = writeJob(ctx, tx, p.OrgID, d, &old, now)
				if err == nil && limitsTightened(old.MaxConcurrency, old.MaxConcurrencyPerKey, d.MaxConcurrency, d.MaxConcurrencyPerKey) {
					// The job's tasks admitted under the old limits wait again,
					// and are admitted as far as the new ones allow.
					_, err = tx.Exec(ctx, sqlWithdraw, p.OrgID, c.Name, nil)
					withdrawn = append(withdrawn, withdrawal{job: &c.Name})
				}
			case c.Kind == job.KindJob && c.Op == job.OpDelete:
				_, err = tx.Exec(ctx, sqlJobDelete, p.OrgID, c.Name)
			case c.Kind == job.KindWorkflow && c.Op == job.OpCreate:
				err = writeWorkflow(ctx, tx, p.OrgID, flows[c.Name], nil, now)
			case c.Kind == job.KindWorkflow && c.Op == job.OpUpdate:
				old := storedFlows[c.Name]
				err = writeWorkflow(ctx, tx, p.OrgID, flows[c.Name], &old, now)
			case c.Kind == job.KindWorkflow && c.Op == job.OpDelete:
				_, err = tx.Exec(ctx, sqlWorkflowDelete, p.OrgID, c.Name)
			case c.Kind == job.KindType && (c.Op == job.OpCreate || c.Op == job.OpUpdate):
				l := limits[c.Name]
				if l.MaxConcurrency == 0 && l.MaxConcurrencyPerKey == 0 {
					err = unsetTypeLimit(ctx, tx, p.OrgID, c.Name)
				} else {
					_, err = tx.Exec(ctx, sqlTypeLimitSet, p.OrgID, c.Name, l.MaxConcurrency, l.MaxConcurrencyPerKey)
					// The type's tasks admitted under no or looser limits wait
					// again, and are admitted as far as the new ones allow.
					if o := storedTypes[c.Name]; err == nil &&
						limitsTightened(o.MaxConcurrency, o.MaxConcurrencyPerKey, l.MaxConcurrency, l.MaxConcurrencyPerKey) {
						_, err = tx.Exec(ctx, sqlWithdraw, p.OrgID, nil, c.Name)
						withdrawn = append(withdrawn, withdrawal{typ: &c.Name})
					}
				}
			case c.Kind == job.KindType && c.Op == job.OpDelete:
				err = unsetTypeLimit(ctx, tx, p.OrgID, c.Name)
			}
			if err != nil {
				return fmt.Errorf("%s %s: %w", c.Kind, c.Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return nil, translate(err)
	}
	if !dryRun {
		err = s.settle(ctx, p, withdrawn)
		call(s.OnChange)
	}
	return changes, err
}

// unsetTypeLimit removes a type's limits, and its row unless it is paused.
func unsetTypeLimit(ctx context.Context, tx pgx.Tx, org uuid.UUID, typ string) error {
	if _, err := tx.Exec(ctx, sqlTypeLimitUnset, org, typ); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, sqlTypeLimitDrop, org, typ)
	return err
}

// writeJob inserts d, or updates it over old. A schedule's cursor starts at
// its first tick after now, and starts again there when the schedule, its
// time zone or its activity changed.
func writeJob(ctx context.Context, tx pgx.Tx, org uuid.UUID, d job.Definition, old *job.Definition, now time.Time) error {
	def, err := json.Marshal(d)
	if err != nil {
		return err
	}
	schedule, tz, missed, next, err := cursor(d.Source, now)
	if err != nil {
		return err
	}
	args := []any{org, d.Name, d.Type, d.Payload, d.Priority, schedule, tz, missed, d.MaxAttempts, d.TimeoutSeconds,
		d.HeartbeatTimeoutSeconds, d.MaxConcurrency, d.MaxConcurrencyPerKey, d.Active, d.Hash(), def, next}
	if old == nil {
		_, err = tx.Exec(ctx, sqlJobInsert, args...)
		return err
	}
	o := old.Normalized()
	_, err = tx.Exec(ctx, sqlJobUpdate, append(args, scheduleMoved(o.Source, d.Source, o.Active, d.Active))...)
	return err
}

// orgWide is the scope of an act on the whole org that p may take: a
// pause holds back every task of its job or type, those restricted to
// roles p does not hold among them, or they would run on while the rest
// wait.
func orgWide(p auth.Principal) auth.Scope { return auth.Scope{OrgID: p.OrgID, SeeAll: true} }

// PauseJob pauses (or, with pause false, resumes) a job: while paused its
// schedule does not tick and its tasks not yet started wait; running ones
// finish.
func (s *JobStore) PauseJob(ctx context.Context, p auth.Principal, name string, pause bool) error {
	if task.ValidateType(name) != nil {
		return missing("job", name)
	}
	var withdrawn []withdrawal
	err := inScope(ctx, s.pool, orgWide(p), func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlWaitForAdmission); err != nil {
			return err
		}
		var schedule *string
		var tz, missed string
		var next *time.Time
		var paused bool
		if !pause {
			err := tx.QueryRow(ctx, sqlJobResumeState, p.OrgID, name).Scan(&schedule, &tz, &missed, &next, &paused)
			if err != nil {
				return err
			}
		}
		var id uuid.UUID
		if err := tx.QueryRow(ctx, sqlJobPause, p.OrgID, name, pause).Scan(&id); err != nil {
			return err
		}
		if pause {
			_, err := tx.Exec(ctx, sqlWithdraw, p.OrgID, name, nil)
			withdrawn = append(withdrawn, withdrawal{job: &name})
			return err
		}
		if !paused || schedule == nil || next == nil {
			return nil
		}
		// The ticks that passed while the job was paused were missed, even
		// those within the scheduler's catch-up window (which is there for
		// a scheduler that was down): they follow the job's missed policy.
		// A schedule that no longer reads is left to the scheduler, which
		// reports it and reads it again later.
		if sched, err := job.Schedule(*schedule, tz); err == nil {
			if cur := job.ResumeCursor(sched, *next, time.Now(), missed); !cur.Equal(*next) {
				_, err = tx.Exec(ctx, sqlJobAdvance, id, cur)
				return err
			}
		}
		return nil
	})
	if err != nil {
		return notFound(translate(err), "job")
	}
	err = s.settle(ctx, p, withdrawn)
	call(s.OnChange)
	return err
}

// PauseType pauses (or resumes) a task type in the org: its tasks not yet
// started wait; running ones finish.
func (s *JobStore) PauseType(ctx context.Context, p auth.Principal, typ string, pause bool) error {
	if err := task.ValidateType(typ); err != nil {
		return err
	}
	var withdrawn []withdrawal
	err := inScope(ctx, s.pool, orgWide(p), func(tx pgx.Tx) error {
		if !pause {
			if _, err := tx.Exec(ctx, sqlTypeResume, p.OrgID, typ); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, sqlTypeLimitDrop, p.OrgID, typ)
			return err
		}
		if _, err := tx.Exec(ctx, sqlWaitForAdmission); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, sqlTypePause, p.OrgID, typ); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, sqlWithdraw, p.OrgID, nil, typ)
		withdrawn = append(withdrawn, withdrawal{typ: &typ})
		return err
	})
	if err != nil {
		return translate(err)
	}
	err = s.settle(ctx, p, withdrawn)
	call(s.OnChange)
	return err
}

// Trigger makes a task of a job now, with the job's payload unless payload
// is given, and the concurrency key given.
func (s *JobStore) Trigger(ctx context.Context, p auth.Principal, name string, payload json.RawMessage, key string, trace task.Carrier) (task.Task, error) {
	j, err := s.Job(ctx, p, name)
	if err != nil {
		return task.Task{}, err
	}
	d := j.Definition.Normalized()
	if given := bytes.TrimSpace(payload); len(given) == 0 || bytes.Equal(given, []byte("null")) {
		payload = d.Payload
	}
	sub, err := task.NewSubmission(task.SubmitInput{Type: d.Type, Payload: payload, Priority: &d.Priority,
		MaxAttempts: &d.MaxAttempts, Dedupe: new(bool), ConcurrencyKey: key, TimeoutSeconds: d.TimeoutSeconds,
		HeartbeatTimeoutSeconds: d.HeartbeatTimeoutSeconds}, task.Defaults{MaxAttempts: d.MaxAttempts}, "")
	if err != nil {
		return task.Task{}, err
	}
	sub.OrgID, sub.JobID = p.OrgID, &j.ID
	var rows submitRows
	if err := rows.add(sub, p.Actor(), trace); err != nil {
		return task.Task{}, err
	}
	t, err := scanTask(scopedRow(ctx, s.pool, p.Scope(), sqlSubmit, rows.args()...))
	if errors.Is(err, pgx.ErrNoRows) {
		return task.Task{}, errors.New("trigger: the task was not written")
	}
	if err != nil {
		return task.Task{}, translate(err)
	}
	call(s.OnOutbox)
	call(s.OnChange)
	return t, nil
}
