package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// submitGroup commits single submissions made at about the same time
// together. Each commit waits for PostgreSQL to flush the WAL to disk, and
// under load the commits of one-task transactions queue up behind those
// flushes: the submissions that arrive while earlier ones are being written
// wait, and the next group takes them all, in one round trip and one
// transaction. A lone submission goes at once, with no added wait.
//
// A group shares the caller's scope (the org and roles row-level security
// checks), so it holds submissions of one scope only. Its rows are written
// in (type, input hash) order, as SubmitBatch writes them, so that two
// groups sharing inputs wait for each other instead of deadlocking. When
// the group's transaction fails, each of its submissions runs again alone,
// so that one bad submission fails alone with its own error.
type submitGroup struct {
	pool *pgxpool.Pool
	// flushers bounds the groups in flight: fewer, larger groups mean
	// fewer WAL flushes.
	flushers int
	// max bounds a group's size.
	max int

	mu      sync.Mutex
	queue   []*submitCall
	running int
}

// groupTimeout bounds a group's transaction, which no one caller's context
// does: a caller that leaves must not cut the others' writes short.
const groupTimeout = time.Minute

type submitCall struct {
	ctx   context.Context
	scope auth.Scope
	key   string
	sub   task.Submission
	by    *task.Principal
	trace task.Carrier
	done  chan struct{}

	// The outcome, set before done is closed: the task written, or
	// created false when the input is already a task's (dedupe).
	task    task.Task
	created bool
	err     error
}

func newSubmitGroup(pool *pgxpool.Pool, flushers, max int) *submitGroup {
	return &submitGroup{pool: pool, flushers: flushers, max: max}
}

// submit writes sub in scope sc and reports whether it made a new task (or
// found its input already a task's, when sub dedupes). ctx bounds the wait
// for a group; a caller that leaves before its group is taken writes
// nothing. Once a group has taken the call, its outcome is the answer,
// even after ctx ends: the group's transaction does not end with one
// caller, and an error answered meanwhile could hide a task it wrote.
func (g *submitGroup) submit(ctx context.Context, sc auth.Scope, sub task.Submission, by *task.Principal,
	trace task.Carrier) (task.Task, bool, error) {
	c := &submitCall{ctx: ctx, scope: sc, key: groupKey(sc), sub: sub, by: by, trace: trace, done: make(chan struct{})}
	g.mu.Lock()
	g.queue = append(g.queue, c)
	if g.running < g.flushers {
		g.running++
		go g.drain()
	}
	g.mu.Unlock()
	select {
	case <-c.done:
		return c.task, c.created, c.err
	case <-ctx.Done():
		g.mu.Lock()
		i := slices.Index(g.queue, c)
		if i >= 0 {
			g.queue = slices.Delete(g.queue, i, i+1)
		}
		g.mu.Unlock()
		if i >= 0 {
			return task.Task{}, false, context.Cause(ctx)
		}
		<-c.done
		return c.task, c.created, c.err
	}
}

// drain writes groups until the queue is empty.
func (g *submitGroup) drain() {
	for {
		g.mu.Lock()
		if len(g.queue) == 0 {
			g.running--
			g.mu.Unlock()
			return
		}
		key := g.queue[0].key
		var calls []*submitCall
		rest := g.queue[:0]
		for _, c := range g.queue {
			if c.key == key && len(calls) < g.max {
				calls = append(calls, c)
			} else {
				rest = append(rest, c)
			}
		}
		clear(g.queue[len(rest):])
		g.queue = rest
		g.mu.Unlock()
		g.flush(calls)
	}
}

func (g *submitGroup) flush(calls []*submitCall) {
	defer func() {
		for _, c := range calls {
			close(c.done)
		}
	}()
	if len(calls) == 1 {
		g.alone(calls[0])
		return
	}
	sent, err := g.together(calls)
	switch {
	case err == nil:
	case !sent || pgCode(err) != "":
		// Refused whole, before it was sent or by PostgreSQL, which
		// rolled it back: each call again alone, so that a bad one fails
		// alone.
		for _, c := range calls {
			g.alone(c)
		}
	default:
		// The connection failed: the transaction may have committed,
		// and writing the calls again could make their tasks twice.
		for _, c := range calls {
			c.err = err
		}
	}
}

// together writes calls in one transaction: the scope, then one submit
// statement for all of them, pipelined. sent tells whether it reached
// PostgreSQL.
func (g *submitGroup) together(calls []*submitCall) (sent bool, err error) {
	slices.SortStableFunc(calls, func(a, b *submitCall) int {
		if n := strings.Compare(a.sub.Type, b.sub.Type); n != 0 {
			return n
		}
		return strings.Compare(a.sub.InputHash, b.sub.InputHash)
	})
	var rows submitRows
	for _, c := range calls {
		if err := rows.add(c.sub, c.by, c.trace); err != nil {
			return false, err
		}
	}
	b := &pgx.Batch{}
	b.Queue(sqlSetScope, scopeArgs(calls[0].scope)...)
	var made map[uuid.UUID]task.Task
	b.Queue(sqlSubmit, rows.args()...).Query(func(r pgx.Rows) error {
		var err error
		made, err = collectSubmitted(r)
		return err
	})
	// The statements' spans hang under the first caller's span, which the
	// context keeps; the group does not end when that caller leaves.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(calls[0].ctx), groupTimeout)
	defer cancel()
	if err := g.pool.SendBatch(ctx, b).Close(); err != nil {
		return true, err
	}
	for i, c := range calls {
		c.task, c.created = made[rows.ids[i]]
	}
	return true, nil
}

// alone writes c in a transaction of its own, under its caller's context.
func (g *submitGroup) alone(c *submitCall) {
	c.task, c.created, c.err = submitAlone(c.ctx, g.pool, c.scope, c.sub, c.by, c.trace)
}

// submitAlone writes sub in a transaction of its own: the scope and the
// statement, in one round trip.
func submitAlone(ctx context.Context, pool *pgxpool.Pool, sc auth.Scope, sub task.Submission, by *task.Principal,
	trace task.Carrier) (task.Task, bool, error) {
	var rows submitRows
	if err := rows.add(sub, by, trace); err != nil {
		return task.Task{}, false, err
	}
	t, err := scanTask(scopedRow(ctx, pool, sc, sqlSubmit, rows.args()...))
	if errors.Is(err, pgx.ErrNoRows) {
		return task.Task{}, false, nil
	}
	return t, err == nil, err
}

// groupKey tells scopes apart: the values sqlSetScope sets, quoted.
func groupKey(sc auth.Scope) string {
	return fmt.Sprintf("%q", scopeArgs(sc))
}
