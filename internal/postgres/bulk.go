package postgres

import (
	"context"
	"slices"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// A bulk action counts the tasks its filter matches and picks those it
// will change, the pick written for the count; then applies the
// lifecycle's transition to each, fenced by the version it read, in one
// statement.

const (
	nameBulkCount = "tasks.bulk_count"
	nameBulkPick  = "tasks.bulk_pick"
	// nameBulkPickFew is the pick of a filter that matches few tasks.
	nameBulkPickFew = "tasks.bulk_pick_few"
)

// bulkWhere selects the tasks of org that f matches and that the action
// would change: in one of statuses (the action's, narrowed by the
// filter's). A running task already asked to stop is left out of a
// cancel: task.OnCancel writes nothing for it, so counting it would make a
// filter match forever. A task of a workflow run is left out of a retry:
// it is retried with its run.
//
// The statuses are spelt out, running apart from the rest: an org's
// running tasks are in tasks_running and its others in tasks_org_status
// (migration 014), and the planner takes both only for a condition that
// names each index's statuses in an arm of its own.
func bulkWhere(org uuid.UUID, a task.Action, statuses []task.Status, f task.Filter) *where {
	f.Status = ""
	w := taskWhere(org, f)
	var arms []string
	if others := notInProgress(statuses); len(others) > 0 {
		arms = append(arms, "status IN ("+litList(others)+")")
	}
	if slices.Contains(statuses, task.StatusInProgress) {
		running := isRunning
		if a == task.ActionCancel {
			running += " AND cancel_requested_at IS NULL"
		}
		arms = append(arms, "("+running+")")
	}
	if len(arms) == 0 {
		arms = append(arms, "false")
	}
	w.and(strings.Join(arms, " OR "))
	// A task of a workflow run is retried with its run (APIStore.Retry),
	// unless retention has deleted the run: then it is retried alone.
	if a == task.ActionRetry {
		w.and("(run_id IS NULL OR NOT EXISTS (SELECT 1 FROM workflow_runs r WHERE r.id = tasks.run_id))")
	}
	return w
}

// bulkCountSQL counts the tasks a bulk action matches.
func bulkCountSQL(org uuid.UUID, a task.Action, statuses []task.Status, f task.Filter) (string, []any) {
	w := bulkWhere(org, a, statuses, f)
	return named(nameBulkCount, `SELECT count(*) FROM tasks WHERE `+w.String()), w.args
}

// bulkPickSQL reads where the first limit of them stand, in id order (the
// order the transition statement locks them in); of the tasks ids alone,
// when not nil.
//
// When the count found at most fewMatched tasks (matched), every match is
// read through the indexes the count took, and sorted. Otherwise the
// planner may walk the primary key in id order until limit of them turn
// up, which is quick while the matches are many and spread over the
// table, and reads the whole table when they are few, or old and new
// with none between: a cancel of an org's backlog behind a few tasks
// scheduled long ago read a million rows (78,000 buffers, seconds) to
// pick 1,000 of its 12,000 tasks in flight.
func bulkPickSQL(org uuid.UUID, a task.Action, statuses []task.Status, f task.Filter, limit int, ids []uuid.UUID,
	matched int) (string, []any) {
	w := bulkWhere(org, a, statuses, f)
	if ids != nil {
		w.and("id = ANY (" + w.arg(ids) + ")")
	}
	n := w.arg(limit)
	if matched <= fewMatched {
		// OFFSET 0 keeps the matches a subquery of their own, planned
		// for all of them rather than for the first few in id order.
		return named(nameBulkPickFew, `SELECT id, status, version, cancel_pending, traceparent FROM (
	SELECT id, status, version, cancel_requested_at IS NOT NULL AS cancel_pending, coalesce(traceparent, '') AS traceparent
	FROM tasks WHERE `+w.String()+` OFFSET 0) m
ORDER BY id LIMIT `+n), w.args
	}
	return named(nameBulkPick, `SELECT id, status, version, cancel_requested_at IS NOT NULL, coalesce(traceparent, '')
	FROM tasks WHERE `+w.String()+` ORDER BY id LIMIT `+n), w.args
}

// fewMatched is the most matches a bulk action's pick reads all of: no
// more rows than the count before it read index entries.
const fewMatched = 50000

// pickedTask is a task a bulk action picked: where it stands, and the
// trace it has (a retry replaces it, and links to it).
type pickedTask struct {
	task.Standing
	traceparent string
}

// scanPicked reads a row of bulkPickSQL.
func scanPicked(row pgx.CollectableRow) (pickedTask, error) {
	var pt pickedTask
	var status string
	err := row.Scan(&pt.ID, &status, &pt.Version, &pt.CancelPending, &pt.traceparent)
	pt.Status = task.Status(status)
	return pt, err
}

// maxBulkTries bounds the times a bulk action applies its change to a task
// whose version moved in the meantime, its status not.
const maxBulkTries = 5

var (
	_ = statement(nameBulkCount, widest(bulkCountSQL(uuid.Max, task.ActionCancel, task.ActionCancel.Statuses(), widestFilter)))
	_ = statement(nameBulkPick, widest(bulkPickSQL(uuid.Max, task.ActionCancel, task.ActionCancel.Statuses(), widestFilter, 1,
		[]uuid.UUID{uuid.Max}, fewMatched+1)))
	_ = statement(nameBulkPickFew, widest(bulkPickSQL(uuid.Max, task.ActionCancel, task.ActionCancel.Statuses(), widestFilter,
		1, []uuid.UUID{uuid.Max}, 0)))
)

// Bulk applies an action to every task of the principal's org that the
// filter matches and the principal may see (at most b.Limit of them), or
// with b.DryRun only counts them. With b.Expected set, a filter that now
// matches more tasks than that is a conflict (the result still holds the
// count), and no more than that many tasks change. Each task gets the
// transition the single-task endpoint would apply, at the version read: a
// task that moved meanwhile is skipped, and one whose version alone moved
// (a running task's lease renewal) is read again and changed. Everything
// happens in one transaction of the principal's scope.
//
// A retry gives each task the request's trace, as the single retry does,
// and links the request's span to every trace the retried tasks had (once
// each), where their failed attempts are.
func (s *APIStore) Bulk(ctx context.Context, p auth.Principal, b task.Bulk, trace task.Carrier) (task.BulkResult, error) {
	statuses, err := b.Action.Narrow(b.Filter.Status)
	if err != nil {
		return task.BulkResult{}, err
	}
	limit := b.Limit
	if b.Expected != nil {
		limit = min(limit, *b.Expected)
	}
	var res task.BulkResult
	var queued bool
	var replaced []string // the traces of the tasks retried
	act := func(tx pgx.Tx) error {
		res, queued, replaced = task.BulkResult{}, false, nil
		countSQL, countArgs := bulkCountSQL(p.OrgID, b.Action, statuses, b.Filter)
		if err := tx.QueryRow(ctx, countSQL, countArgs...).Scan(&res.Matched); err != nil {
			return err
		}
		if b.Expected != nil && res.Matched > *b.Expected {
			return task.Errorf(task.ErrCodeConflict, "the filter matches %d tasks now, more than the %d expected: "+
				"count them again and confirm that number", res.Matched, *b.Expected)
		}
		if b.DryRun {
			return nil
		}
		// The pick is written for the count: how to find the first
		// matches in id order depends on how many there are.
		pickSQL, pickArgs := bulkPickSQL(p.OrgID, b.Action, statuses, b.Filter, limit, nil, res.Matched)
		rows, err := tx.Query(ctx, pickSQL, pickArgs...)
		if err != nil {
			return err
		}
		picked, err := pgx.CollectRows(rows, scanPicked)
		if err != nil {
			return err
		}
		res.More = res.Matched > len(picked)
		for try := 1; len(picked) > 0; try++ {
			changes := make([]task.Change, 0, len(picked))
			for _, st := range picked {
				tr, err := b.Action.Decide(st.Status, st.CancelPending)
				if err != nil || tr == "" {
					res.Skipped++ // cannot happen for the rows bulkWhere picks
					continue
				}
				changes = append(changes, task.Change{TaskID: st.ID, Version: st.Version, Transition: tr,
					Trace: trace, By: p.Actor()})
			}
			if len(changes) == 0 {
				return nil
			}
			applied, errs, q, err := apply(ctx, tx, changes)
			if err != nil {
				return err
			}
			if i := slices.IndexFunc(errs, func(err error) bool { return err != nil }); i >= 0 {
				return errs[i]
			}
			queued = queued || q
			status := map[uuid.UUID]task.Status{}
			had := map[uuid.UUID]string{}
			for _, st := range picked {
				status[st.ID], had[st.ID] = st.Status, st.traceparent
			}
			was := map[uuid.UUID]task.Status{}
			for i, a := range applied {
				if !a.Fenced {
					res.Changed++
					replaced = append(replaced, had[changes[i].TaskID])
				} else if try < maxBulkTries {
					was[changes[i].TaskID] = status[changes[i].TaskID]
				} else {
					res.Skipped++
				}
			}
			if len(was) == 0 {
				return nil
			}
			// A fenced task's version moved. A running task's lease
			// renewals and progress reports move it and nothing else: one
			// still in the status it was picked in, and still matched, is
			// changed after all; one a worker moved on is skipped.
			ids := make([]uuid.UUID, 0, len(was))
			for id := range was {
				ids = append(ids, id)
			}
			sql, args := bulkPickSQL(p.OrgID, b.Action, statuses, b.Filter, len(ids), ids, len(ids))
			rows, err := tx.Query(ctx, sql, args...)
			if err != nil {
				return err
			}
			again, err := pgx.CollectRows(rows, scanPicked)
			if err != nil {
				return err
			}
			picked = slices.DeleteFunc(again, func(st pickedTask) bool { return st.Status != was[st.ID] })
			res.Skipped += len(was) - len(picked)
		}
		return nil
	}
	// The tasks a bulk action settles lock their parents and workflow runs
	// (migration 007) in the order of the tasks; a worker's batch settling
	// tasks of the same parents or runs in another order can deadlock with
	// it. PostgreSQL then rolls the action back whole, and it runs again,
	// counting anew.
	err = retryDeadlocks(func() error { return inScope(ctx, s.pool, p.Scope(), act) })
	if err != nil {
		return res, translate(err)
	}
	if b.Action == task.ActionRetry {
		linkTraces(ctx, replaced, "previous attempt")
	}
	if queued {
		s.onOutbox()
	}
	if res.Changed > 0 {
		call(s.OnEvents)
	}
	return res, nil
}
