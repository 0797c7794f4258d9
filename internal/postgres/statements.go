package postgres

import (
	"slices"
	"strings"

	"github.com/conveyorhq/conveyor/internal/task"
)

// Statement is one named SQL statement of the adapter.
type Statement struct {
	Name string
	SQL  string
}

var statements []Statement

// statement names a SQL statement and registers it. The name leads the text
// as a comment, so database spans, server logs and pg_stat_statements say
// what a statement does ("tasks.claim") rather than how it starts ("WITH").
func statement(name, sql string) string {
	text := named(name, sql)
	statements = append(statements, Statement{Name: name, SQL: text})
	return text
}

// named is sql led by its name, as statement writes it: for the shapes of
// a dynamic statement, built per call, whose widest form statement
// registered.
func named(name, sql string) string { return "-- " + name + "\n" + strings.TrimSpace(sql) }

// Statements lists every statement the adapter runs (a dynamic one in its
// widest form), so a test can prepare each against the migrated schema.
func Statements() []Statement { return append([]Statement(nil), statements...) }

// StatementName is the name a statement's text carries, or "" for SQL that
// did not come from statement.
func StatementName(sql string) string {
	rest, ok := strings.CutPrefix(sql, "-- ")
	if !ok {
		return ""
	}
	name, _, ok := strings.Cut(rest, "\n")
	if !ok || strings.ContainsAny(name, " \t") {
		return ""
	}
	return name
}

// lit is a status as a SQL literal: the lifecycle's statuses are defined in
// package task, and the statements spell them from there.
func lit(s task.Status) string { return "'" + string(s) + "'" }

// notInProgress is ss without IN_PROGRESS: the statuses tasks_org_status
// holds, running tasks being in tasks_running alone (migration 014).
func notInProgress(ss []task.Status) []task.Status {
	return slices.DeleteFunc(slices.Clone(ss), func(s task.Status) bool { return s == task.StatusInProgress })
}

// litList is a list of statuses as SQL literals, for IN (...).
func litList(ss []task.Status) string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = lit(s)
	}
	return strings.Join(out, ", ")
}

// Conditions on a task row, spelt from the lifecycle's statuses.
var (
	isPending  = "status = " + lit(task.StatusPending)
	isRunning  = "status = " + lit(task.StatusInProgress)
	isTerminal = "status IN (" + litList(task.TerminalStatuses()) + ")"
	// notRunning is spelt as the predicate of tasks_org_status, which
	// holds every task but the running ones (migration 014), so that the
	// planner sees the index serves it.
	notRunning = "status IN (" + litList(notInProgress(task.Statuses)) + ")"
)
