package httpapi

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// countedRead is an overview read that counts its calls, each answering
// its number as the PENDING count, and waits for release when it has one.
type countedRead struct {
	calls   atomic.Int64
	release chan struct{}
	// took is how long each read takes by the share's clock.
	took  time.Duration
	clock *fakeClock
}

func (c *countedRead) read(ctx context.Context) (overviewView, error) {
	n := c.calls.Add(1)
	if c.release != nil {
		select {
		case <-c.release:
		case <-ctx.Done():
			return overviewView{}, ctx.Err()
		}
	}
	if c.clock != nil {
		c.clock.advance(c.took)
	}
	return overviewView{Counts: map[task.Status]int{task.StatusPending: int(n)}}, nil
}

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// Callers that ask for the same overview while it is being read wait for
// that one read, however many they are (open dashboards, CLI watchers);
// one that stops waiting does not cancel it for the others.
func TestConcurrentOverviewCallersShareOneRead(t *testing.T) {
	t.Parallel()
	o := newOverviewShare()
	r := &countedRead{release: make(chan struct{})}
	const callers = 8
	gone, leave := context.WithCancel(context.Background())
	answers := make(chan overviewView, callers)
	errs := make(chan error, callers)
	for i := range callers {
		ctx := context.Background()
		if i == 0 {
			ctx = gone
		}
		go func() {
			v, err := o.get(ctx, "org/-/", 0, r.read)
			if err != nil {
				errs <- err
				return
			}
			answers <- v
		}()
	}
	require.Eventually(t, func() bool { return o.callers("org/-/") == callers }, 10*time.Second, time.Millisecond)
	leave()
	require.ErrorIs(t, <-errs, context.Canceled)
	close(r.release)
	for range callers - 1 {
		v := <-answers
		require.Equal(t, 1, v.Counts[task.StatusPending])
		require.False(t, v.AsOf.IsZero())
	}
	require.EqualValues(t, 1, r.calls.Load())

	// Read once it is over, a cheap overview is read afresh.
	v, err := o.get(context.Background(), "org/-/", 0, r.read)
	require.NoError(t, err)
	require.Equal(t, 2, v.Counts[task.StatusPending])
}

// A costly overview is handed out again, with the time it was read, for
// four times as long as it took; a cheap one and another scope's are not,
// and a bulk action on the org has it read afresh.
func TestACostlyOverviewIsHandedOutAgainForAWhile(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	o := newOverviewShare()
	o.now = clock.now
	org, other := uuid.New(), uuid.New()
	reader := overviewKey(auth.Principal{OrgID: org, Role: auth.Reader})
	admin := overviewKey(auth.Principal{OrgID: org, Role: auth.Admin})
	costly := &countedRead{clock: clock, took: 2 * time.Second}
	get := func(key string, r *countedRead) overviewView {
		t.Helper()
		v, err := o.get(context.Background(), key, time.Minute, r.read)
		require.NoError(t, err)
		return v
	}

	first := get(reader, costly)
	require.Equal(t, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), first.AsOf)
	clock.advance(7 * time.Second) // 8 s after the read ended, less 1 s
	require.Equal(t, first, get(reader, costly))
	require.EqualValues(t, 1, costly.calls.Load())
	require.Equal(t, 2, get(admin, costly).Counts[task.StatusPending], "another scope shares nothing")

	clock.advance(8 * time.Second)
	again := get(reader, costly)
	require.Equal(t, 3, again.Counts[task.StatusPending])
	require.True(t, again.AsOf.After(first.AsOf))

	o.forget(other)
	require.Equal(t, again, get(reader, costly))
	o.forget(org)
	require.Equal(t, 4, get(reader, costly).Counts[task.StatusPending])

	cheap := &countedRead{clock: clock, took: 10 * time.Millisecond}
	key := overviewKey(auth.Principal{OrgID: other, Role: auth.Reader})
	get(key, cheap)
	get(key, cheap)
	require.EqualValues(t, 2, cheap.calls.Load())
}

// The key tells apart what decides what an overview shows: the org, the
// org roles (in any order) and seeing every task.
func TestOverviewKeyFollowsTheScope(t *testing.T) {
	t.Parallel()
	org := uuid.New()
	reader := auth.Principal{OrgID: org, Role: auth.Reader, OrgRoles: []string{"b", "a"}}
	require.Equal(t, overviewKey(reader), overviewKey(auth.Principal{OrgID: org, Role: auth.Writer, OrgRoles: []string{"a", "b"}}))
	require.NotEqual(t, overviewKey(reader), overviewKey(auth.Principal{OrgID: org, Role: auth.Reader, OrgRoles: []string{"a"}}))
	require.NotEqual(t, overviewKey(reader), overviewKey(auth.Principal{OrgID: org, Role: auth.Admin, OrgRoles: []string{"a", "b"}}))
	require.NotEqual(t, overviewKey(reader), overviewKey(auth.Principal{OrgID: uuid.New(), Role: auth.Reader, OrgRoles: []string{"a", "b"}}))
}

// A bulk action has its org's overview read afresh even when every caller
// of the read under way has stopped waiting for it (a client gave up on a
// slow overview): the next caller does not take that read, begun before
// the bulk action, as its answer.
func TestForgetDropsAReadNoOneWaitsFor(t *testing.T) {
	t.Parallel()
	o := newOverviewShare()
	org := uuid.New()
	key := overviewKey(auth.Principal{OrgID: org, Role: auth.Reader})
	before := &countedRead{release: make(chan struct{})}
	defer close(before.release)
	gone, leave := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := o.get(gone, key, 0, before.read)
		left <- err
	}()
	require.Eventually(t, func() bool { return before.calls.Load() == 1 }, 10*time.Second, time.Millisecond)
	leave()
	require.ErrorIs(t, <-left, context.Canceled)

	o.forget(org)
	fresh := make(chan struct{})
	answer := make(chan overviewView, 1)
	go func() {
		v, err := o.get(context.Background(), key, 0, func(context.Context) (overviewView, error) {
			close(fresh)
			return overviewView{Counts: map[task.Status]int{task.StatusPending: 42}}, nil
		})
		if err == nil {
			answer <- v
		}
	}()
	select {
	case <-fresh:
	case <-time.After(10 * time.Second):
		t.Fatal("the caller after the bulk action waits for the read begun before it")
	}
	require.Equal(t, 42, (<-answer).Counts[task.StatusPending])
}
