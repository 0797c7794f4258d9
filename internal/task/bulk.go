package task

import "slices"

// MaxBulkLimit bounds the tasks one bulk action changes; a filter that
// matches more is worked through call by call.
const MaxBulkLimit = 1000

// Action is what a bulk request does to every task its filter matches:
// the client's cancel or retry, applied task by task through the same
// decisions (OnCancel, OnRetry) as the single-task endpoints.
type Action string

// The bulk actions.
const (
	ActionCancel Action = "cancel"
	ActionRetry  Action = "retry"
)

// Statuses lists the statuses of the tasks the action can change: where
// the transitions it picks start.
func (a Action) Statuses() []Status {
	switch a {
	case ActionCancel:
		return slices.Concat(Lifecycle[CancelPending].From, Lifecycle[RequestCancel].From)
	case ActionRetry:
		return slices.Clone(Lifecycle[Retry].From)
	}
	return nil
}

// Narrow returns the statuses a bulk action covers for a filter on status
// (empty: every status it can change). A status the action can never
// change is invalid: the request could only ever match nothing.
func (a Action) Narrow(status Status) ([]Status, error) {
	all := a.Statuses()
	if status == "" {
		return all, nil
	}
	if !status.In(all) {
		return nil, Invalid("filter.status", "%s applies only to tasks in %v, not %s", a, all, status)
	}
	return []Status{status}, nil
}

// Decide picks the transition the action applies to a task in status, with
// or without a cancel already pending; an empty transition means there is
// nothing to change.
func (a Action) Decide(status Status, cancelPending bool) (Transition, error) {
	switch a {
	case ActionCancel:
		tr, _, err := OnCancel(status, cancelPending)
		return tr, err
	case ActionRetry:
		return OnRetry(status)
	}
	return "", Errorf(ErrCodeInvalid, "unknown bulk action %q", a)
}

// Bulk asks for an action on every task of the caller's org that Filter
// matches and the caller may see.
type Bulk struct {
	Action Action
	Filter Filter
	// DryRun counts the tasks the action would change, and changes none.
	DryRun bool
	// Expected, when not nil, is the count the caller confirmed: if the
	// filter now matches more tasks, nothing changes (a conflict), and
	// never more than Expected tasks change.
	Expected *int
	// Limit bounds the tasks this call changes (1..MaxBulkLimit).
	Limit int
}

// BulkResult is what a bulk action did.
type BulkResult struct {
	// Matched is how many tasks the filter matched that the action can
	// change.
	Matched int
	// Changed tasks took the action's transition; Skipped ones changed
	// meanwhile (their version moved) and were left alone.
	Changed, Skipped int
	// More: the filter matched more tasks than this call took on.
	More bool
}
