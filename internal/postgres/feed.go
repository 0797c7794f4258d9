package postgres

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The statements of live streams: the feed every API instance reads once
// for all its subscribers, and the catch-up a resuming subscriber reads in
// its own scope.

// EventsChannel is the LISTEN/NOTIFY channel that wakes the API's stream
// hubs when task events are committed.
const EventsChannel = "conveyor_events"

// eventColumns are the columns scanEvent reads: the event and, for
// filtering a stream, its task's org, type and visibility.
const eventColumns = `e.id, e.task_id, e.status, e.state, e.progress, coalesce(e.error, ''), e.detail, e.actor,
	e.principal, e.created_at, e.org_id, t.type, t.visibility`

// sqlFeed reads the events after an id, oldest first, each with the
// snapshot they were read in: one statement, so the rows and the snapshot
// agree. Each event's task is looked up by its key (the OFFSET 0 keeps the
// lookup a nested loop): joined as a table, the planner hashed every task
// to read the one or two events a wake-up brings.
var sqlFeed = statement("task_events.feed", `SELECT pg_current_snapshot()::text, `+eventColumns+`
	FROM task_events e
	CROSS JOIN LATERAL (SELECT type, visibility FROM tasks WHERE tasks.id = e.task_id OFFSET 0) t
	WHERE e.id > $1 ORDER BY e.id LIMIT $2`)

var sqlFeedHead = statement("task_events.head",
	`SELECT coalesce(max(id), 0), pg_current_snapshot()::text FROM task_events`)

// sqlOrgEventsBetween and sqlTaskEventsBetween are the catch-up of a
// stream: the events in (after, upto] a caller sees, oldest first.
var sqlOrgEventsBetween = statement("task_events.org_between", `SELECT `+eventColumns+`
	FROM task_events e JOIN tasks t ON t.id = e.task_id
	WHERE e.org_id = $1 AND e.id > $2 AND e.id <= $3 AND ($4 = '' OR t.type = $4) AND ($5 = '' OR e.status = $5)
	ORDER BY e.id LIMIT $6`)

var sqlTaskEventsBetween = statement("task_events.task_between", `SELECT `+eventColumns+`
	FROM task_events e JOIN tasks t ON t.id = e.task_id
	WHERE e.task_id = $1 AND e.org_id = $2 AND e.id > $3 AND e.id <= $4
	ORDER BY e.id LIMIT $5`)

// sqlOrgReached is whether the caller's org has had an event with an id
// of $2 or more: one still stored (the range past a hub's cursor is
// short), or one retention deleted since. Other orgs' events, which share
// the ids' sequence, do not count: nothing here tells how far they went.
var sqlOrgReached = statement("task_events.org_reached", `SELECT
	EXISTS (SELECT 1 FROM task_events WHERE id >= $2 AND org_id = $1)
	OR coalesce((SELECT events_expired_through >= $2 FROM orgs WHERE id = $1), false)`)

func scanEvent(row pgx.Row, extra ...any) (task.Event, error) {
	var e task.Event
	var status, actor string
	dest := []any{&e.ID, &e.TaskID, &status, &e.State, &e.Progress, &e.Error, &e.Detail, &actor, &e.By,
		&e.CreatedAt, &e.OrgID, &e.Type, &e.Visibility}
	if err := row.Scan(append(extra, dest...)...); err != nil {
		return task.Event{}, err
	}
	e.Status, e.Actor = task.Status(status), task.Actor(actor)
	return e, nil
}

// Snapshot is a PostgreSQL snapshot: which transactions had finished when
// it was taken.
type Snapshot struct {
	Xmin, Xmax uint64
	// Xip are the transactions in progress, sorted.
	Xip []uint64
}

// ParseSnapshot reads the text form of pg_snapshot, "xmin:xmax:xip,...".
func ParseSnapshot(s string) (Snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return Snapshot{}, fmt.Errorf("snapshot %q: want xmin:xmax:xip", s)
	}
	var snap Snapshot
	var err error
	if snap.Xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if snap.Xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			xid, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
			}
			snap.Xip = append(snap.Xip, xid)
		}
	}
	slices.Sort(snap.Xip)
	return snap, nil
}

// Finished reports whether every one of xids had committed or aborted when
// the snapshot was taken.
func (s Snapshot) Finished(xids []uint64) bool {
	for _, x := range xids {
		if x >= s.Xmax {
			return false
		}
		if _, running := slices.BinarySearch(s.Xip, x); running {
			return false
		}
	}
	return true
}

// EventFeed reads every org's events for the API's stream hub. It runs on
// the owner's pool: it filters nothing, the hub does per subscriber.
type EventFeed struct{ pool *pgxpool.Pool }

// NewEventFeed returns the feed of pool's events.
func NewEventFeed(pool *pgxpool.Pool) *EventFeed { return &EventFeed{pool: pool} }

// Head returns the newest event id and the snapshot it was read in.
func (f *EventFeed) Head(ctx context.Context) (int64, Snapshot, error) {
	var head int64
	var snap string
	if err := f.pool.QueryRow(ctx, sqlFeedHead).Scan(&head, &snap); err != nil {
		return 0, Snapshot{}, translate(err)
	}
	s, err := ParseSnapshot(snap)
	return head, s, err
}

// Read returns up to limit events after the id after, oldest first, and
// the snapshot they were read in (the zero Snapshot when there are none).
func (f *EventFeed) Read(ctx context.Context, after int64, limit int) ([]task.Event, Snapshot, error) {
	rows, err := f.pool.Query(ctx, sqlFeed, after, limit)
	if err != nil {
		return nil, Snapshot{}, translate(err)
	}
	var snap string
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.Event, error) {
		return scanEvent(row, &snap)
	})
	if err != nil || len(events) == 0 {
		return nil, Snapshot{}, translate(err)
	}
	s, err := ParseSnapshot(snap)
	return events, s, err
}

// OrgReached reports whether p's org has had an event with the id id or
// a later one, even if retention deleted it since: whether a stream could
// have sent the org that id.
func (s *APIStore) OrgReached(ctx context.Context, p auth.Principal, id int64) (bool, error) {
	var reached bool
	err := scopedRow(ctx, s.pool, p.Scope(), sqlOrgReached, p.OrgID, id).Scan(&reached)
	return reached, translate(err)
}

// EventsBetween returns the events in (after, upto] of the tasks p sees,
// oldest first, at most limit: the catch-up of a stream that resumes. f
// narrows them to one task, a type or a status.
func (s *APIStore) EventsBetween(ctx context.Context, p auth.Principal, f task.EventFilter, after, upto int64, limit int) ([]task.Event, error) {
	scan := func(row pgx.CollectableRow) (task.Event, error) { return scanEvent(row) }
	var events []task.Event
	var err error
	if f.TaskID != uuid.Nil {
		events, err = scopedRows(ctx, s.pool, p.Scope(), scan, sqlTaskEventsBetween, f.TaskID, p.OrgID, after, upto, limit)
	} else {
		events, err = scopedRows(ctx, s.pool, p.Scope(), scan, sqlOrgEventsBetween, p.OrgID, after, upto,
			f.Type, string(f.Status), limit)
	}
	return events, translate(err)
}
