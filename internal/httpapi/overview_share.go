package httpapi

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/singleflight"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// An overview reads every task of the caller's org that the caller may see:
// on an org of hundreds of thousands of tasks that is seconds of one
// database connection, and the dashboard asks again every 5 s in every open
// tab (as do CLI watchers). So callers who would see the same overview —
// the same org, org roles and see-all — share it:
//   - callers that ask while it is being read wait for that read instead of
//     starting their own;
//   - an overview that took at least overviewCostly to read is handed out
//     again for overviewReuseFactor times as long as it took (at most
//     overviewMaxReuse), so that however many watch a large org, its
//     overview keeps at most a fifth of one connection busy. A cheap one
//     is read afresh for each caller but those already waiting.
//
// Each answer says when it was read (as_of). The share is this instance's
// own, and nothing is written to the database for it; a bulk action through
// this instance makes its org's overviews read afresh.
const (
	overviewCostly      = 250 * time.Millisecond
	overviewReuseFactor = 4
	overviewMaxReuse    = 30 * time.Second
)

// sharedOverview is an overview's answer and until when it is handed out
// again.
type sharedOverview struct {
	view  overviewView
	until time.Time
}

// overviewShare shares overviews between the callers that would see the
// same one.
type overviewShare struct {
	now func() time.Time
	// costly, factor and maxReuse are the overviewCostly,
	// overviewReuseFactor and overviewMaxReuse of this share.
	costly   time.Duration
	factor   int
	maxReuse time.Duration

	// reads runs one read of a key at a time for all its callers.
	reads singleflight.Group

	mu    sync.Mutex
	ready map[string]sharedOverview // by overviewKey, until expired
	// waiting counts the callers waiting for a read, by overviewKey.
	waiting map[string]int
	// reading counts the reads under way, by overviewKey, whether or not
	// a caller still waits for them (after a forget, an earlier read and
	// a later one may be under way at once).
	reading map[string]int
	// forgotten counts an org's forget calls (by the org part of its
	// keys): a read begun before one is not handed out again.
	forgotten map[string]uint64
}

func newOverviewShare() *overviewShare {
	return &overviewShare{now: time.Now, costly: overviewCostly, factor: overviewReuseFactor,
		maxReuse: overviewMaxReuse, ready: map[string]sharedOverview{}, waiting: map[string]int{},
		reading: map[string]int{}, forgotten: map[string]uint64{}}
}

// overviewKey names what decides what an overview shows: the org and what
// of its tasks the principal may see. The org comes first, up to a "/".
func overviewKey(p auth.Principal) string {
	sc := p.Scope()
	roles := slices.Clone(sc.Roles)
	slices.Sort(roles)
	seeAll := "-"
	if sc.SeeAll {
		seeAll = "all"
	}
	return sc.OrgID.String() + "/" + seeAll + "/" + strings.Join(roles, ",")
}

// orgOf is the org part of an overviewKey.
func orgOf(key string) string {
	org, _, _ := strings.Cut(key, "/")
	return org
}

// get returns the overview of key: one still handed out, the one being
// read, or one read now by read. read runs apart from the caller's
// context (other callers may be waiting for it), bounded by timeout when
// positive; the caller stops waiting when ctx ends.
func (o *overviewShare) get(ctx context.Context, key string, timeout time.Duration,
	read func(ctx context.Context) (overviewView, error)) (overviewView, error) {
	org := orgOf(key)
	o.mu.Lock()
	if s, ok := o.ready[key]; ok && o.now().Before(s.until) {
		o.mu.Unlock()
		return s.view, nil
	}
	forgotten := o.forgotten[org]
	o.waiting[key]++
	o.mu.Unlock()
	defer func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.waiting[key]--; o.waiting[key] == 0 {
			delete(o.waiting, key)
		}
	}()

	rctx := context.WithoutCancel(ctx)
	answer := o.reads.DoChan(key, func() (any, error) {
		ctx, cancel := rctx, context.CancelFunc(func() {})
		if timeout > 0 {
			ctx, cancel = context.WithTimeout(rctx, timeout)
		}
		defer cancel()
		o.mu.Lock()
		o.reading[key]++
		o.mu.Unlock()
		start := o.now()
		v, err := read(ctx)
		v.AsOf = start.UTC()
		o.done(key, forgotten, v, start, err == nil)
		return v, err
	})
	select {
	case r := <-answer:
		return r.Val.(overviewView), r.Err
	case <-ctx.Done():
		return overviewView{}, ctx.Err()
	}
}

// done ends the read of key, and keeps the overview it read (ok) from
// start to hand out again when it was costly, unless its org was forgotten
// since the read began.
func (o *overviewShare) done(key string, forgotten uint64, v overviewView, start time.Time, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.reading[key]--; o.reading[key] == 0 {
		delete(o.reading, key)
	}
	if !ok {
		return
	}
	now := o.now()
	for k, s := range o.ready {
		if !now.Before(s.until) {
			delete(o.ready, k)
		}
	}
	if took := now.Sub(start); took >= o.costly && o.forgotten[orgOf(key)] == forgotten {
		o.ready[key] = sharedOverview{view: v, until: now.Add(min(took*time.Duration(o.factor), o.maxReuse))}
	}
}

// forget drops the org's overviews handed out again, and lets those being
// read answer only the callers already waiting: a bulk action changed many
// of its tasks, and the dashboard reads the overview again at once.
func (o *overviewShare) forget(org uuid.UUID) {
	id := org.String()
	o.mu.Lock()
	defer o.mu.Unlock()
	o.forgotten[id]++
	for k := range o.ready {
		if orgOf(k) == id {
			delete(o.ready, k)
		}
	}
	// Every read under way, even one whose callers all stopped waiting:
	// a caller after the bulk action would take it as its answer.
	for k := range o.reading {
		if orgOf(k) == id {
			o.reads.Forget(k)
		}
	}
}

// callers is how many callers are waiting for the overview of key.
func (o *overviewShare) callers(key string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.waiting[key]
}
