package postgres

import (
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/task"
)

// The statements that select tasks by a client's filter (a listing, a bulk
// action) are written per call, with a condition for each filter the
// client set and none for the others: the planner then sees the query's
// real shape (a search by id is a primary key lookup, a listing with no
// filter walks the org's task_listing rows) instead of a generic plan full of
// "$n = '' OR …" that fits no shape well. statement registers each in its
// widest form, so the schema test still prepares every condition.

// where is a WHERE clause under construction: conditions joined by AND,
// with their arguments numbered in the order they were added.
type where struct {
	conds []string
	args  []any
}

// arg adds an argument and returns its placeholder.
func (w *where) arg(v any) string {
	w.args = append(w.args, v)
	return "$" + strconv.Itoa(len(w.args))
}

func (w *where) and(cond string) { w.conds = append(w.conds, cond) }

func (w *where) String() string {
	if len(w.conds) == 0 {
		return "true"
	}
	return "(" + strings.Join(w.conds, ") AND (") + ")"
}

// taskWhere selects the tasks of org that f matches (the row-level
// security policy adds the caller's visibility).
func taskWhere(org uuid.UUID, f task.Filter) *where {
	w := &where{}
	w.and("org_id = " + w.arg(org))
	if f.Type != "" {
		w.and("type = " + w.arg(f.Type))
	}
	taskConds(w, f)
	return w
}

// taskConds adds f's conditions on the task's own columns: all but the
// org and the type.
func taskConds(w *where, f task.Filter) {
	if f.Status != "" {
		w.and("status = " + w.arg(string(f.Status)))
	}
	if !f.CreatedAfter.IsZero() {
		w.and("created_at >= " + w.arg(f.CreatedAfter))
	}
	if !f.CreatedBefore.IsZero() {
		w.and("created_at < " + w.arg(f.CreatedBefore))
	}
	if f.ID != uuid.Nil {
		w.and("id = " + w.arg(f.ID))
	}
	if f.MetaKey != "" {
		w.and("metadata->>" + w.arg(f.MetaKey) + " = " + w.arg(f.MetaValue))
	}
}

// widestFilter sets every filter, for the registered form of the dynamic
// statements.
var widestFilter = task.Filter{Status: task.StatusPending, Type: "t", CreatedAfter: time.Unix(1, 0),
	CreatedBefore: time.Unix(2, 0), ID: uuid.Max, MetaKey: "k", MetaValue: "v"}

// listSQL is the listing of the tasks f selects, newest first, as
// summaries. It walks the org's task_listing rows (of f's type, if set)
// newest first, and reads each task by primary key, until a page is full;
// the tasks' indexes hold no key of the org's tasks in id order
// (migration 011).
func listSQL(org uuid.UUID, f task.ListFilter) (string, []any) {
	listed := &where{}
	orgArg := listed.arg(org)
	listed.and("org_id = " + orgArg)
	if f.Type != "" {
		listed.and("type = " + listed.arg(f.Type))
	}
	after := ""
	if f.After != uuid.Nil {
		after = listed.arg(f.After)
		listed.and("id < " + after)
	}
	// The org is said of the tasks too, so that a status filter can take
	// tasks_org_status; the type is not (the planner would count its
	// selectivity twice, and sort a rare type's every task). So is the
	// cursor: the planner may merge the listing with the tasks' primary
	// key, and that walk starts at the cursor only when told of it (else
	// a page deep in a large org read every newer task first).
	w := &where{args: listed.args}
	w.and("org_id = " + orgArg)
	if after != "" {
		w.and("id < " + after)
	}
	taskConds(w, f.Filter)
	limit := w.arg(f.Limit)
	return named(nameList, `SELECT `+summaryColumns+` FROM tasks
	JOIN (SELECT id AS listed_id FROM task_listing WHERE `+listed.String()+`) l ON l.listed_id = tasks.id
	WHERE `+w.String()+`
	ORDER BY id DESC LIMIT `+limit), w.args
}

const nameList = "tasks.list"

var _ = statement(nameList, widest(listSQL(uuid.Max, task.ListFilter{Filter: widestFilter, After: uuid.Max, Limit: 1})))

// widest is the text of a dynamic statement's widest form, without the
// name statement adds again.
func widest(sql string, _ []any) string {
	_, body, _ := strings.Cut(sql, "\n")
	return body
}
