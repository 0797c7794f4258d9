package postgres

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/robfig/cron/v3"
	"go.opentelemetry.io/otel/propagation"

	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The scheduler's statements: it makes the tasks of cron jobs' ticks, and
// admits the tasks that wait in PostgreSQL (limited, paused or in a type's
// fair mode) to the outbox, and so to the broker.

// schedulerLock is the advisory lock a scheduling pass holds for its
// transaction: two passes (a leader and one just deposed) never count the
// same slots at once.
const schedulerLock = 0x636f6e76 // "conv"

var sqlSchedulerLock = statement("scheduler.lock", `SELECT pg_try_advisory_xact_lock(`+fmt.Sprint(schedulerLock)+`)`)

// sqlTypeLoad reads each known type's mode, the concurrency of the live
// workers that consume it, how many of its admitted tasks are due and not
// yet claimed (counted only up to one past its window: beyond, the number
// does not matter; NULL for the types of $4, counted recently, while in
// fair mode with no task waiting), and whether any of its tasks wait for
// admission. $1 is a fixed window (0: the capacity, at least $3).
//
// Both reads go through small indexes, of the tasks a queue holds
// (tasks_ready) and of waiting tasks. Each is ordered as its index is, and
// as no other index is: with LIMIT alone the planner may take a scan of
// the table, betting that matching rows come early (in a backlog burnt
// down in order they come last), or the index of every PENDING task by
// due time, walking a backlog that waits for admission.
var sqlTypeLoad = statement("scheduler.type_load", `
SELECT k.name, k.admit_directly, c.capacity, c.win,
	CASE WHEN q.waiting OR k.admit_directly OR k.name <> ALL ($4::text[]) THEN
		(SELECT count(*) FROM (SELECT 1 FROM tasks t WHERE t.type = k.name AND t.`+isPending+` AND t.admitted
			AND t.next_run_at <= now() ORDER BY t.type, t.next_run_at, t.id LIMIT c.win + 1) r) END,
	q.waiting
FROM task_types k
CROSS JOIN LATERAL (
	SELECT w.capacity, CASE WHEN $1 > 0 THEN $1 ELSE greatest(w.capacity, $3) END AS win
	FROM (SELECT coalesce(sum(concurrency), 0)::int AS capacity FROM workers
		WHERE k.name = ANY (types) AND last_heartbeat_at > now() - $2 * interval '1 millisecond') w) c
CROSS JOIN LATERAL (
	SELECT (SELECT true FROM tasks t WHERE t.type = k.name AND t.`+isPending+` AND NOT t.admitted
		ORDER BY t.type, t.org_id, t.concurrency_key LIMIT 1) IS NOT NULL AS waiting) q`)

// sqlSchedulerSettings sets a pass's planner. Its statements are short, and
// their plans' costs (a backlog of waiting tasks) would make PostgreSQL
// compile them each time: no JIT. And every ordered read of the pass has
// an index in its order, which a sort must not undercut: on a fresh
// backlog, not analyzed yet, the planner expects one matching row and
// counts a type's queued tasks by walking all of its open ones, with a
// heap fetch each, then sorting them (50–150 ms a pass in a burn-down of
// 60,000 tasks, against a few ms along tasks_ready).
var sqlSchedulerSettings = statement("scheduler.settings",
	`SELECT set_config('jit', 'off', true), set_config('enable_sort', 'off', true)`)

var sqlTypeMode = statement("scheduler.type_mode", `UPDATE task_types SET admit_directly = $2 WHERE name = $1`)

// sqlWaitingGroups lists the groups (type, org, concurrency key) that have
// tasks waiting for admission, after the group ($2, $3, $4), skipping
// through the waiting index one group at a time however many tasks each
// holds; groups of a type paused in their org are left out.
var sqlWaitingGroups = statement("scheduler.waiting_groups", waitingSkipScan(
	"AND (type, org_id, concurrency_key) > ($2::text, $3::uuid, $4::text)",
	"(type, org_id, concurrency_key) > (g.type, g.org_id, g.concurrency_key)"))

// sqlWaitingPairs lists the first group of each (type, org) that has tasks
// waiting for admission, skipping through the waiting index one pair at a
// time; pairs of a type paused in their org are left out.
var sqlWaitingPairs = statement("scheduler.waiting_pairs", waitingSkipScan("",
	"(type, org_id) > (g.type, g.org_id)"))

// waitingSkipScan is a statement that walks the waiting index from its
// first group matching start (a condition, or none), then from each group
// to the first one past it by next, and lists up to $1 groups of types not
// paused in their org.
func waitingSkipScan(start, next string) string {
	return `
WITH RECURSIVE g AS (
	(SELECT type, org_id, concurrency_key FROM tasks WHERE ` + isPending + ` AND NOT admitted
		` + start + `
		ORDER BY type, org_id, concurrency_key LIMIT 1)
	UNION ALL
	SELECT n.type, n.org_id, n.concurrency_key FROM g CROSS JOIN LATERAL (
		SELECT type, org_id, concurrency_key FROM tasks
		WHERE ` + isPending + ` AND NOT admitted AND ` + next + `
		ORDER BY type, org_id, concurrency_key LIMIT 1) n
)
SELECT g.type, g.org_id, g.concurrency_key FROM g
WHERE NOT EXISTS (SELECT 1 FROM type_limits l WHERE l.org_id = g.org_id AND l.type = g.type AND l.paused_at IS NOT NULL)
LIMIT $1`
}

// sqlWaitingTasks reads up to $4 due waiting tasks of each group, in the
// order they are admitted within it, without those of paused jobs, nor
// those of jobs (or jobs' keys) whose slots are all held: a job's backlog
// at its limit would otherwise fill its group's places in every pass, and
// hold up the other tasks of its type, org and key behind it.
var sqlWaitingTasks = statement("scheduler.waiting_tasks", `
WITH full_job AS MATERIALIZED (
	SELECT j.id FROM jobs j
	WHERE j.org_id = ANY ($2::uuid[]) AND j.max_concurrency IS NOT NULL
		AND (SELECT count(*) FROM tasks a WHERE a.job_id = j.id AND a.admitted
			AND a.status IN (`+litList([]task.Status{task.StatusPending, task.StatusInProgress})+`)) >= j.max_concurrency
), full_key AS MATERIALIZED (
	SELECT a.job_id, a.concurrency_key FROM jobs j JOIN tasks a ON a.job_id = j.id
	WHERE j.org_id = ANY ($2::uuid[]) AND j.max_concurrency_per_key IS NOT NULL AND a.concurrency_key <> ''
		AND a.admitted AND a.status IN (`+litList([]task.Status{task.StatusPending, task.StatusInProgress})+`)
	GROUP BY a.job_id, a.concurrency_key, j.max_concurrency_per_key
	HAVING count(*) >= j.max_concurrency_per_key
)
SELECT c.id, c.type, c.org_id, c.concurrency_key, c.job_id, c.priority
FROM unnest($1::text[], $2::uuid[], $3::text[]) AS g(type, org_id, concurrency_key)
CROSS JOIN LATERAL (
	SELECT t.id, t.type, t.org_id, t.concurrency_key, t.job_id, t.priority FROM tasks t
	WHERE t.`+isPending+` AND NOT t.admitted AND t.type = g.type AND t.org_id = g.org_id
		AND t.concurrency_key = g.concurrency_key AND t.next_run_at <= now() AND t.state <> '`+task.StateAwaiting+`'
		AND (t.job_id IS NULL OR (NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = t.job_id AND j.paused_at IS NOT NULL)
			AND NOT EXISTS (SELECT 1 FROM full_job f WHERE f.id = t.job_id)
			AND NOT EXISTS (SELECT 1 FROM full_key f WHERE f.job_id = t.job_id AND f.concurrency_key = t.concurrency_key)))
	ORDER BY t.priority DESC, t.id LIMIT $4) c`)

// sqlQueuedByPriority counts, per priority, the queued tasks (admitted,
// due, unclaimed) of each type of $1, reading at most $2 of each, the
// oldest, along tasks_ready as sqlTypeLoad does.
var sqlQueuedByPriority = statement("scheduler.queued_by_priority", `
SELECT k.type, r.priority, count(*) FROM unnest($1::text[], $2::int[]) AS k(type, cap)
CROSS JOIN LATERAL (
	SELECT t.priority FROM tasks t WHERE t.type = k.type AND t.`+isPending+` AND t.admitted
		AND t.next_run_at <= now() ORDER BY t.type, t.next_run_at, t.id LIMIT k.cap) r
GROUP BY 1, 2`)

// sqlTypeLimits reads the limits of the (org, type) pairs named.
var sqlTypeLimits = statement("scheduler.type_limits", `
SELECT l.type, l.org_id, coalesce(l.max_concurrency, 0), coalesce(l.max_concurrency_per_key, 0)
FROM type_limits l JOIN unnest($1::text[], $2::uuid[]) AS p(type, org_id) USING (type, org_id)`)

// sqlJobLimits reads the limits of the jobs named.
var sqlJobLimits = statement("scheduler.job_limits", `
SELECT id, coalesce(max_concurrency, 0), coalesce(max_concurrency_per_key, 0) FROM jobs WHERE id = ANY ($1)`)

// sqlHeldByType counts, per (type, org, key), the admitted tasks of the
// pairs named that have not finished: the slots they hold. The queued
// ones are read through tasks_admitted and the running ones through
// tasks_running (migration 014).
var sqlHeldByType = statement("scheduler.held_by_type", `
SELECT h.type, h.org_id, h.concurrency_key, count(*) FROM unnest($1::text[], $2::uuid[]) AS p(type, org_id)
CROSS JOIN LATERAL (
	SELECT t.type, t.org_id, t.concurrency_key FROM tasks t
	WHERE t.type = p.type AND t.org_id = p.org_id AND t.admitted AND t.`+isPending+`
	UNION ALL
	SELECT t.type, t.org_id, t.concurrency_key FROM tasks t
	WHERE t.org_id = p.org_id AND t.type = p.type AND t.admitted AND t.`+isRunning+`
) h
GROUP BY 1, 2, 3`)

// sqlHeldByJob counts the slots held per (job, key).
var sqlHeldByJob = statement("scheduler.held_by_job", `
SELECT job_id, concurrency_key, count(*) FROM tasks
WHERE job_id = ANY ($1) AND admitted AND status IN (`+litList([]task.Status{task.StatusPending, task.StatusInProgress})+`)
GROUP BY 1, 2`)

// sqlAdmit admits waiting tasks: each gets its task.run message.
var sqlAdmit = statement("scheduler.admit", `
WITH upd AS (
	UPDATE tasks SET admitted = true, updated_at = now(),
		state = CASE WHEN state = '`+task.StateWaiting+`' THEN '`+task.StateQueued+`' ELSE state END
	WHERE id = ANY ($1) AND `+isPending+` AND NOT admitted
	RETURNING id, org_id, type, attempt, version, priority, next_run_at, traceparent,
		'`+string(outbox.KindRun)+`'::text AS message, NULL::jsonb AS headers
), message AS (
	`+enqueue("upd")+`
)
SELECT count(*) FROM upd`)

// sqlDueJobs locks the scheduled jobs whose next tick is due by the pass's
// clock ($2), the one its ticks are computed with.
var sqlDueJobs = statement("scheduler.due_jobs", `
SELECT id, org_id, type, payload, priority, schedule, timezone, missed, max_attempts,
	coalesce(timeout_seconds, 0), coalesce(heartbeat_timeout_seconds, 0), next_tick_at
FROM jobs WHERE active AND schedule IS NOT NULL AND paused_at IS NULL AND next_tick_at <= $2
ORDER BY next_tick_at LIMIT $1
FOR UPDATE SKIP LOCKED`)

var sqlJobAdvance = statement("scheduler.job_advance", `UPDATE jobs SET next_tick_at = $2 WHERE id = $1`)

// sqlDueWorkflows locks the scheduled workflows whose next tick is due.
var sqlDueWorkflows = statement("scheduler.due_workflows", `
SELECT org_id, id, definition, next_tick_at FROM workflows
WHERE active AND schedule IS NOT NULL AND next_tick_at <= $2
ORDER BY next_tick_at LIMIT $1
FOR UPDATE SKIP LOCKED`)

var sqlWorkflowAdvance = statement("scheduler.workflow_advance", `UPDATE workflows SET next_tick_at = $2 WHERE id = $1`)

// SchedulerStore runs the scheduler's statements.
type SchedulerStore struct {
	pool     *pgxpool.Pool
	onOutbox func()
	// OnEvents, when set, is called after a commit that wrote task events.
	OnEvents func()

	mu sync.Mutex
	// counted holds each type's last count of queued tasks, and when it
	// was taken (AdmitConfig.RecountAfter).
	counted map[string]count
	// after is the last group the previous pass read: when more groups
	// wait than a pass reads, the next pass goes on from there, so groups
	// held back by their limits do not hide the others for ever.
	after group
}

// group is a group of waiting tasks: a type, an org and a concurrency key.
type group struct {
	typ string
	org uuid.UUID
	key string
}

// count is a type's count of queued tasks, as read at a time.
type count struct {
	ready int
	at    time.Time
}

// NewSchedulerStore returns the scheduler's store; onOutbox is called after
// every commit that wrote outbox messages.
func NewSchedulerStore(pool *pgxpool.Pool, onOutbox func()) *SchedulerStore {
	return &SchedulerStore{pool: pool, onOutbox: onOutbox}
}

type typeLoad struct {
	direct   bool
	ready    int
	waiting  bool
	capacity int
	window   int
}

type scopeKey struct {
	typ string
	org uuid.UUID
	job uuid.UUID
	key string
}

type limits struct{ total, perKey int }

type candidate struct {
	id       uuid.UUID
	typ      string
	org      uuid.UUID
	key      string
	job      *uuid.UUID
	priority int
}

// Admit runs one admission pass in one transaction: it moves each type in
// or out of fair mode, then admits waiting tasks as far as their limits
// and their type's window allow, the most urgent first, and taking turns
// between orgs within a priority (the org with the fewest tasks in flight
// in the type goes first).
func (s *SchedulerStore) Admit(ctx context.Context, cfg job.AdmitConfig) (job.AdmitStats, error) {
	var st job.AdmitStats
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		st = job.AdmitStats{}
		var locked bool
		if err := tx.QueryRow(ctx, sqlSchedulerLock).Scan(&locked); err != nil || !locked {
			st.Busy = !locked
			return err
		}
		if _, err := tx.Exec(ctx, sqlSchedulerSettings); err != nil {
			return err
		}
		loads, err := s.typeLoads(ctx, tx, cfg)
		if err != nil {
			return err
		}
		admitted, err := s.admitWaiting(ctx, tx, cfg, loads)
		if err != nil {
			return err
		}
		st.Admitted = admitted
		for name, l := range loads {
			direct := l.direct
			switch {
			case direct && l.ready > l.window:
				direct = false
			case !direct && !l.waiting && l.ready <= l.window/2:
				direct = true
			}
			if direct != l.direct {
				if _, err := tx.Exec(ctx, sqlTypeMode, name, direct); err != nil {
					return err
				}
			}
			if !direct {
				st.Fair = append(st.Fair, name)
			}
			st.Waiting = st.Waiting || l.waiting
		}
		slices.Sort(st.Fair)
		return nil
	})
	if err != nil {
		return job.AdmitStats{}, translate(err)
	}
	if st.Admitted > 0 {
		call(s.onOutbox)
	}
	return st, nil
}

// typeLoads reads every type's load. A type in fair mode with no task
// waiting, counted within cfg.RecountAfter, keeps the count it had then.
func (s *SchedulerStore) typeLoads(ctx context.Context, tx pgx.Tx, cfg job.AdmitConfig) (map[string]*typeLoad, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	fresh := []string{} // not nil: a NULL array would spare every type
	for name, c := range s.counted {
		if now.Sub(c.at) < cfg.RecountAfter {
			fresh = append(fresh, name)
		}
	}
	rows, err := tx.Query(ctx, sqlTypeLoad, cfg.Window, cfg.DeadAfter.Milliseconds(), cfg.MinWindow, fresh)
	if err != nil {
		return nil, err
	}
	loads := map[string]*typeLoad{}
	counted := map[string]count{}
	var name string
	var l typeLoad
	var ready *int
	_, err = pgx.ForEachRow(rows, []any{&name, &l.direct, &l.capacity, &l.window, &ready, &l.waiting}, func() error {
		c := l
		if ready != nil {
			c.ready, counted[name] = *ready, count{ready: *ready, at: now}
		} else {
			c.ready, counted[name] = s.counted[name].ready, s.counted[name]
		}
		loads[name] = &c
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.counted = counted
	return loads, nil
}

// admitWaiting admits waiting tasks and returns how many; it updates each
// type's ready count and whether tasks still wait.
func (s *SchedulerStore) admitWaiting(ctx context.Context, tx pgx.Tx, cfg job.AdmitConfig, loads map[string]*typeLoad) (int, error) {
	s.mu.Lock()
	after := s.after
	s.mu.Unlock()
	var groups []group
	scan := func(rows pgx.Rows) error {
		var g group
		_, err := pgx.ForEachRow(rows, []any{&g.typ, &g.org, &g.key}, func() error {
			groups = append(groups, g)
			return nil
		})
		return err
	}
	read := func(from group, limit int) error {
		rows, err := tx.Query(ctx, sqlWaitingGroups, limit, from.typ, from.org, from.key)
		if err != nil {
			return err
		}
		return scan(rows)
	}
	if err := read(after, cfg.MaxGroups); err != nil {
		return 0, err
	}
	if len(groups) < cfg.MaxGroups && after != (group{}) {
		// Round again from the first group, up to where this pass began.
		if err := read(group{}, cfg.MaxGroups-len(groups)); err != nil {
			return 0, err
		}
		for i, g := range groups {
			if i > 0 && g == groups[0] {
				groups = groups[:i]
				break
			}
		}
	}
	next := group{}
	if len(groups) == cfg.MaxGroups {
		next = groups[len(groups)-1]
	}
	s.mu.Lock()
	s.after = next
	s.mu.Unlock()
	if next != (group{}) {
		// More groups wait than a pass reads: an org whose groups this
		// pass did not reach (behind another org's flood of keys) still
		// takes its turn, with its first group.
		in := map[scopeKey]bool{}
		for _, g := range groups {
			in[scopeKey{typ: g.typ, org: g.org}] = true
		}
		first := len(groups)
		rows, err := tx.Query(ctx, sqlWaitingPairs, cfg.MaxGroups)
		if err != nil {
			return 0, err
		}
		if err := scan(rows); err != nil {
			return 0, err
		}
		kept := groups[:first]
		for _, g := range groups[first:] {
			if !in[scopeKey{typ: g.typ, org: g.org}] {
				kept = append(kept, g)
			}
		}
		groups = kept
	}
	// The types with tasks left waiting that a pass could admit (due, and
	// neither paused nor waiting for children): when this pass read every
	// group, a type with none left keeps no task from a turn, and may
	// admit directly again; a task due tomorrow does not hold it in fair
	// mode till then.
	left := map[string]bool{}
	if next == (group{}) {
		defer func() {
			for name, l := range loads {
				l.waiting = l.waiting && left[name]
			}
		}()
	}
	if len(groups) == 0 {
		return 0, nil
	}

	// Room per type: a fair-mode type fills its window; any other type's
	// waiting tasks wait only for their limits.
	room := map[string]int{}
	for _, g := range groups {
		l := loads[g.typ]
		switch {
		case l == nil:
			room[g.typ] = cfg.MaxAdmit
		case !l.direct:
			room[g.typ] = max(l.window-l.ready, 0)
		default:
			room[g.typ] = cfg.MaxAdmit
		}
	}
	most := 0
	for _, r := range room {
		most = max(most, r)
	}
	perGroup := min(max(most/len(groups)+1, 16), cfg.MaxAdmit)
	types, orgs, keys := make([]string, len(groups)), make([]uuid.UUID, len(groups)), make([]string, len(groups))
	for i, g := range groups {
		types[i], orgs[i], keys[i] = g.typ, g.org, g.key
	}
	rows, err := tx.Query(ctx, sqlWaitingTasks, types, orgs, keys, perGroup)
	if err != nil {
		return 0, err
	}
	var cands []candidate
	var c candidate
	if _, err := pgx.ForEachRow(rows, []any{&c.id, &c.typ, &c.org, &c.key, &c.job, &c.priority}, func() error {
		cands = append(cands, c)
		return nil
	}); err != nil || len(cands) == 0 {
		return 0, err
	}
	// A group that filled its places may hold more.
	inGroup := map[group]int{}
	for _, c := range cands {
		g := group{typ: c.typ, org: c.org, key: c.key}
		if inGroup[g]++; inGroup[g] == perGroup {
			left[c.typ] = true
		}
	}

	queued, err := queuedByPriority(ctx, tx, loads, room, cands)
	if err != nil {
		return 0, err
	}
	// roomFor is the room in its type's window for c: in fair mode only
	// the queued tasks as urgent as c, or more, are ahead of it in the
	// broker, and count.
	roomFor := func(c candidate) int {
		q := queued[c.typ]
		if q == nil {
			return room[c.typ]
		}
		ahead := 0
		for _, n := range q[c.priority:] {
			ahead += n
		}
		return loads[c.typ].window - ahead
	}

	// The limits that apply, and the slots already held.
	pairTypes, pairOrgs := []string{}, []uuid.UUID{}
	seenPair := map[scopeKey]bool{}
	var jobIDs []uuid.UUID
	seenJob := map[uuid.UUID]bool{}
	for _, c := range cands {
		p := scopeKey{typ: c.typ, org: c.org}
		if !seenPair[p] {
			seenPair[p] = true
			pairTypes, pairOrgs = append(pairTypes, c.typ), append(pairOrgs, c.org)
		}
		if c.job != nil && !seenJob[*c.job] {
			seenJob[*c.job] = true
			jobIDs = append(jobIDs, *c.job)
		}
	}
	typeLimit := map[scopeKey]limits{}
	jobLimit := map[uuid.UUID]limits{}
	// Slots held per scope (key ""), and per scope and key; a type's in
	// its org is also what that org has in flight.
	held := map[scopeKey]int{}
	var sk scopeKey
	var lim limits
	rows, err = tx.Query(ctx, sqlTypeLimits, pairTypes, pairOrgs)
	if err != nil {
		return 0, err
	}
	if _, err := pgx.ForEachRow(rows, []any{&sk.typ, &sk.org, &lim.total, &lim.perKey}, func() error {
		typeLimit[scopeKey{typ: sk.typ, org: sk.org}] = lim
		return nil
	}); err != nil {
		return 0, err
	}
	var n int
	rows, err = tx.Query(ctx, sqlHeldByType, pairTypes, pairOrgs)
	if err != nil {
		return 0, err
	}
	if _, err := pgx.ForEachRow(rows, []any{&sk.typ, &sk.org, &sk.key, &n}, func() error {
		held[scopeKey{typ: sk.typ, org: sk.org}] += n
		held[scopeKey{typ: sk.typ, org: sk.org, key: "\x00" + sk.key}] += n
		return nil
	}); err != nil {
		return 0, err
	}
	if len(jobIDs) > 0 {
		var id uuid.UUID
		rows, err = tx.Query(ctx, sqlJobLimits, jobIDs)
		if err != nil {
			return 0, err
		}
		if _, err := pgx.ForEachRow(rows, []any{&id, &lim.total, &lim.perKey}, func() error {
			jobLimit[id] = lim
			return nil
		}); err != nil {
			return 0, err
		}
		rows, err = tx.Query(ctx, sqlHeldByJob, jobIDs)
		if err != nil {
			return 0, err
		}
		var key string
		if _, err := pgx.ForEachRow(rows, []any{&id, &key, &n}, func() error {
			held[scopeKey{job: id}] += n
			held[scopeKey{job: id, key: "\x00" + key}] += n
			return nil
		}); err != nil {
			return 0, err
		}
	}

	// Take turns: the most urgent next candidate goes first; between
	// equally urgent ones, the org with the fewest tasks in flight in its
	// type; a candidate over a limit is passed over.
	queues := map[scopeKey][]candidate{} // per (type, org), in admission order
	var pairs []scopeKey
	for _, c := range cands {
		p := scopeKey{typ: c.typ, org: c.org}
		if _, ok := queues[p]; !ok {
			pairs = append(pairs, p)
		}
		queues[p] = append(queues[p], c)
	}
	// A pair's candidates come group (key) by group: its turn takes the
	// most urgent, then the oldest, whatever its key.
	for _, q := range queues {
		slices.SortStableFunc(q, func(a, b candidate) int {
			if a.priority != b.priority {
				return b.priority - a.priority
			}
			return bytes.Compare(a.id[:], b.id[:])
		})
	}
	rand.Shuffle(len(pairs), func(i, j int) { pairs[i], pairs[j] = pairs[j], pairs[i] })
	// scopes are the limits' scopes a candidate counts in: its type in its
	// org, and its job.
	scopes := func(c candidate) []scopeKey {
		out := []scopeKey{{typ: c.typ, org: c.org}}
		if c.job != nil {
			out = append(out, scopeKey{job: *c.job})
		}
		return out
	}
	limitOf := func(scope scopeKey) limits {
		if scope.job != uuid.Nil {
			return jobLimit[scope.job]
		}
		return typeLimit[scope]
	}
	keyed := func(scope scopeKey, key string) scopeKey {
		scope.key = "\x00" + key
		return scope
	}
	fits := func(c candidate) bool {
		for _, scope := range scopes(c) {
			lim := limitOf(scope)
			if lim.total > 0 && held[scope] >= lim.total {
				return false
			}
			if c.key != "" && lim.perKey > 0 && held[keyed(scope, c.key)] >= lim.perKey {
				return false
			}
		}
		return true
	}
	take := func(c candidate) {
		for _, scope := range scopes(c) {
			held[scope]++
			held[keyed(scope, c.key)]++
		}
	}
	var admit []uuid.UUID
	for len(admit) < cfg.MaxAdmit {
		best := -1
		for i, p := range pairs {
			// A pair's next candidate is its most urgent: when it has no
			// room, none behind it has.
			if len(queues[p]) == 0 || roomFor(queues[p][0]) <= 0 {
				continue
			}
			if best < 0 {
				best = i
				continue
			}
			b := pairs[best]
			if d := queues[p][0].priority - queues[b][0].priority; d > 0 || d == 0 && held[p] < held[b] {
				best = i
			}
		}
		if best < 0 {
			break
		}
		p := pairs[best]
		c := queues[p][0]
		queues[p] = queues[p][1:]
		if !fits(c) {
			left[c.typ] = true
			continue
		}
		take(c)
		room[p.typ]--
		if q := queued[c.typ]; q != nil {
			q[c.priority]++
		}
		admit = append(admit, c.id)
		if l := loads[c.typ]; l != nil {
			l.ready++
		}
	}
	for p, q := range queues {
		if len(q) > 0 {
			left[p.typ] = true
		}
	}
	if len(admit) == 0 {
		return 0, nil
	}
	var done int
	if err := tx.QueryRow(ctx, sqlAdmit, admit).Scan(&done); err != nil {
		return 0, err
	}
	return done, nil
}

// queuedByPriority counts per priority the queued tasks of the fair-mode
// types whose candidates do not all fit the room their window leaves
// (room), so that a waiting task is held back only by the queued tasks
// it would not overtake in the broker. Each type's count reads at most
// a window per priority: beyond (a flood admitted just before fair mode
// came on), the type is left out, and counts as a whole.
func queuedByPriority(ctx context.Context, tx pgx.Tx, loads map[string]*typeLoad, room map[string]int,
	cands []candidate) (map[string]*[task.MaxPriority + 1]int, error) {
	want := map[string]int{}
	for _, c := range cands {
		want[c.typ]++
	}
	var types []string
	var caps []int
	for typ, n := range want {
		if l := loads[typ]; l != nil && !l.direct && n > room[typ] {
			types, caps = append(types, typ), append(caps, (task.MaxPriority+1)*l.window+1)
		}
	}
	if len(types) == 0 {
		return nil, nil
	}
	rows, err := tx.Query(ctx, sqlQueuedByPriority, types, caps)
	if err != nil {
		return nil, err
	}
	out := map[string]*[task.MaxPriority + 1]int{}
	for _, typ := range types {
		out[typ] = &[task.MaxPriority + 1]int{}
	}
	read := map[string]int{}
	var typ string
	var prio, n int
	if _, err := pgx.ForEachRow(rows, []any{&typ, &prio, &n}, func() error {
		out[typ][prio] += n // 0–9, as the table's check holds
		read[typ] += n
		return nil
	}); err != nil {
		return nil, err
	}
	for i, typ := range types {
		if read[typ] >= caps[i] {
			delete(out, typ)
		}
	}
	return out, nil
}

// Cron makes the tasks of the due ticks of scheduled jobs, one per tick
// (the tick's task is unique per job and time, so no two passes make it
// twice), and moves each job's cursor past them, in one transaction.
func (s *SchedulerStore) Cron(ctx context.Context, cfg job.CronConfig, now time.Time) (job.CronStats, error) {
	var st job.CronStats
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		st = job.CronStats{Errors: map[uuid.UUID]error{}}
		type due struct {
			id                         uuid.UUID
			org                        uuid.UUID
			typ                        string
			payload                    []byte
			priority                   int
			schedule, tz, missed       string
			maxAttempts                int
			timeoutS, heartbeatTimeout int
			next                       time.Time
		}
		rows, err := tx.Query(ctx, sqlDueJobs, cfg.MaxJobs, now)
		if err != nil {
			return err
		}
		var jobs []due
		var d due
		if _, err := pgx.ForEachRow(rows, []any{&d.id, &d.org, &d.typ, &d.payload, &d.priority, &d.schedule, &d.tz,
			&d.missed, &d.maxAttempts, &d.timeoutS, &d.heartbeatTimeout, &d.next}, func() error {
			jobs = append(jobs, d)
			return nil
		}); err != nil {
			return err
		}
		flows, err := dueWorkflows(ctx, tx, cfg, now)
		if err != nil {
			return err
		}
		if (len(jobs) > 0 || len(flows) > 0) && cfg.Trace != nil {
			ctx = cfg.Trace(ctx)
		}
		var ticks submitRows
		batch := &pgx.Batch{}
		// Each tick's task carries the trace of the pass that made it (the
		// scheduler's span in ctx), as a request's tasks carry the
		// request's: the task shows it, and its messages take it along.
		trace := passTrace(ctx)
		for _, d := range jobs {
			st.Jobs++
			sched, err := job.Schedule(d.schedule, d.tz)
			if err != nil {
				// Its schedule was valid when applied (a time zone may have
				// left the system's database since): try again later, and
				// meanwhile let the jobs due after it tick.
				st.Errors[d.id] = err
				batch.Queue(sqlJobAdvance, d.id, now.Add(unreadableScheduleRetry))
				continue
			}
			run, skipped, next := dueTicks(sched, d.next, now, d.missed, cfg)
			st.Skipped += skipped
			for _, t := range run {
				at := t
				jobID := d.id
				sub := task.Submission{OrgID: d.org, Type: d.typ, Payload: json.RawMessage(d.payload),
					Metadata: json.RawMessage(`{}`), Priority: d.priority, MaxAttempts: d.maxAttempts,
					Timeout:          time.Duration(d.timeoutS) * time.Second,
					HeartbeatTimeout: time.Duration(d.heartbeatTimeout) * time.Second,
					JobID:            &jobID, ScheduledAt: &at}
				if err := ticks.add(sub, nil, trace); err != nil {
					return err
				}
			}
			batch.Queue(sqlJobAdvance, d.id, next)
		}
		// The jobs' cursors, then all their ticks' tasks in one statement.
		if len(ticks.ids) > 0 {
			batch.Queue(sqlSubmit, ticks.args()...)
		}
		if batch.Len() > 0 {
			br := tx.SendBatch(ctx, batch)
			for range batch.Len() {
				tag, err := br.Exec()
				if err != nil {
					_ = br.Close()
					return err
				}
				if tag.Select() {
					st.Made += int(tag.RowsAffected())
				}
			}
			if err := br.Close(); err != nil {
				return err
			}
		}
		return cronWorkflows(ctx, tx, cfg, now, flows, trace["traceparent"], &st)
	})
	if err != nil {
		return job.CronStats{}, translate(err)
	}
	if st.Made > 0 {
		call(s.onOutbox)
		call(s.OnEvents)
	}
	return st, nil
}

// passTrace is the W3C context of ctx's span, the trace of a scheduler's
// pass, for the tasks it makes.
func passTrace(ctx context.Context) task.Carrier {
	c := task.Carrier{}
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(c))
	return c
}

// unreadableScheduleRetry is how long a job or workflow whose stored
// schedule no longer parses waits before the scheduler reads it again. Left
// due, it would stay the oldest due and, with enough of them, take every
// place of a pass.
const unreadableScheduleRetry = time.Minute

// dueTicks splits the ticks of sched from next (the cursor) to now into
// those to make and the number skipped (missed by more than the catch-up
// time: all but the last with run_once, all with skip), and returns the
// cursor after them. A pass makes at most cfg.MaxTicks.
func dueTicks(sched cron.Schedule, next, now time.Time, missedPolicy string, cfg job.CronConfig) (run []time.Time, skipped int, cursor time.Time) {
	// The cursor is the first tick not made yet, unless it was put off
	// while the schedule did not read (unreadableScheduleRetry): that
	// moment is no tick, and must not become one.
	var ticks []time.Time
	limit := cfg.MaxTicks
	if isTick(sched, next) {
		ticks, limit = append(ticks, next), limit-1
	}
	more, extra := job.Ticks(sched, next, now, limit)
	ticks = append(ticks, more...)
	var missed []time.Time
	for _, t := range ticks {
		if now.Sub(t) > cfg.CatchUp {
			missed = append(missed, t)
		} else {
			run = append(run, t)
		}
	}
	// The cursor follows on from the last tick read, not from now: an
	// "@every" schedule's ticks are its cursor plus whole intervals, and a
	// late pass must not move the ones to come (a cron spec's next tick
	// after the last one is its next after now).
	cursor = sched.Next(now)
	if len(ticks) > 0 {
		cursor = sched.Next(ticks[len(ticks)-1])
	}
	// The latest missed tick is this pass's last one only when the next
	// pass's first tick is not missed too: otherwise run_once would make a
	// task for every pass a long downtime takes.
	latestHere := !extra || now.Sub(cursor) <= cfg.CatchUp
	if len(missed) > 0 {
		if missedPolicy == job.MissedRunOnce && latestHere {
			run = append([]time.Time{missed[len(missed)-1]}, run...)
			skipped = len(missed) - 1
		} else {
			skipped = len(missed)
		}
	}
	return run, skipped, cursor
}

// isTick reports whether sched fires at t. An "@every" schedule's ticks
// follow on from wherever its cursor stands, so any time is one of them.
func isTick(sched cron.Schedule, t time.Time) bool {
	if _, ok := sched.(cron.ConstantDelaySchedule); ok {
		return true
	}
	return sched.Next(t.Add(-time.Second)).Equal(t)
}

// dueWorkflow is a scheduled workflow whose next tick is due.
type dueWorkflow struct {
	org  uuid.UUID
	wf   job.StoredWorkflow
	next time.Time
}

// dueWorkflows reads the scheduled workflows with a tick due.
func dueWorkflows(ctx context.Context, tx pgx.Tx, cfg job.CronConfig, now time.Time) ([]dueWorkflow, error) {
	rows, err := tx.Query(ctx, sqlDueWorkflows, cfg.MaxJobs, now)
	if err != nil {
		return nil, err
	}
	var flows []dueWorkflow
	if _, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (struct{}, error) {
		var d dueWorkflow
		var def []byte
		if err := row.Scan(&d.org, &d.wf.ID, &def, &d.next); err != nil {
			return struct{}{}, err
		}
		if err := json.Unmarshal(def, &d.wf.Definition); err != nil {
			return struct{}{}, fmt.Errorf("workflow %s: stored definition: %w", d.wf.ID, err)
		}
		flows = append(flows, d)
		return struct{}{}, nil
	}); err != nil {
		return nil, err
	}
	return flows, nil
}

// cronWorkflows starts the runs of the due ticks of scheduled workflows, one
// per tick (unique per workflow and time), and moves their cursors.
func cronWorkflows(ctx context.Context, tx pgx.Tx, cfg job.CronConfig, now time.Time, flows []dueWorkflow,
	traceparent string, st *job.CronStats) error {
	for _, d := range flows {
		st.Jobs++
		src := d.wf.Definition.Normalized().Source
		if src == nil {
			continue
		}
		sched, err := job.Schedule(src.Schedule, src.Timezone)
		if err != nil {
			st.Errors[d.wf.ID] = err
			if _, err := tx.Exec(ctx, sqlWorkflowAdvance, d.wf.ID, now.Add(unreadableScheduleRetry)); err != nil {
				return err
			}
			continue
		}
		run, skipped, next := dueTicks(sched, d.next, now, src.Missed, cfg)
		st.Skipped += skipped
		for _, t := range run {
			id, err := uuid.NewV7()
			if err != nil {
				return err
			}
			// The tick is the run's param: each tick is its own input, so
			// memoization never skips a tick's work for the previous one's.
			at := t
			params, _ := json.Marshal(map[string]time.Time{"scheduled_at": at.UTC()}) // a time always encodes
			made, err := startRun(ctx, tx, d.org, d.wf, id, params, false, traceparent, &at, nil)
			if err != nil {
				return err
			}
			if made {
				st.Made++
			}
		}
		if _, err := tx.Exec(ctx, sqlWorkflowAdvance, d.wf.ID, next); err != nil {
			return err
		}
	}
	return nil
}

// CancelStopped cancels up to limit tasks still in flight of runs that
// stopped (failed or cancelled) and of parent tasks that ended without
// completing, and returns how many it changed.
func (s *SchedulerStore) CancelStopped(ctx context.Context, limit int) (int, error) {
	var n int
	var queued bool
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var err error
		n, queued, err = cancelStopped(ctx, tx, nil, limit, nil, nil)
		return err
	})
	if err != nil {
		return 0, translate(err)
	}
	if queued {
		call(s.onOutbox)
	}
	if n > 0 {
		call(s.OnEvents)
	}
	return n, nil
}

// WakeParents queues again up to limit parents whose children have all
// finished but which still wait for them, and returns how many.
func (s *SchedulerStore) WakeParents(ctx context.Context, limit int) (int, error) {
	var n int
	if err := s.pool.QueryRow(ctx, sqlWakeParents, limit).Scan(&n); err != nil {
		return 0, translate(err)
	}
	if n > 0 {
		call(s.onOutbox)
		call(s.OnEvents)
	}
	return n, nil
}
