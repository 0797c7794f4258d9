package stream

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
)

// fakeSource is a table of events, some not committed yet, and the
// transactions still running. (The real gap is tested against PostgreSQL
// in internal/postgres and cmd/worker.)
type fakeSource struct {
	mu        sync.Mutex
	events    []task.Event // committed, in id order
	running   []uint64     // xids in progress
	nextXid   uint64
	headReads int
	reads     int
}

func (f *fakeSource) snapshot() postgres.Snapshot {
	return postgres.Snapshot{Xmin: 1, Xmax: f.nextXid + 1, Xip: slices.Clone(f.running)}
}

func (f *fakeSource) Head(context.Context) (int64, postgres.Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.headReads++
	var head int64
	for _, e := range f.events {
		head = max(head, e.ID)
	}
	return head, f.snapshot(), nil
}

func (f *fakeSource) Read(_ context.Context, after int64, limit int) ([]task.Event, postgres.Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	var out []task.Event
	for _, e := range f.events {
		if e.ID > after && len(out) < limit {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b task.Event) int { return int(a.ID - b.ID) })
	return out, f.snapshot(), nil
}

func (f *fakeSource) commit(events ...task.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, events...)
}

// begin starts a transaction and returns its xid; end finishes it.
func (f *fakeSource) begin() uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextXid++
	f.running = append(f.running, f.nextXid)
	slices.Sort(f.running)
	return f.nextXid
}

func (f *fakeSource) end(xid uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.running = slices.DeleteFunc(f.running, func(x uint64) bool { return x == xid })
}

var (
	orgA  = uuid.MustParse("00000000-0000-0000-0000-00000000000a")
	orgB  = uuid.MustParse("00000000-0000-0000-0000-00000000000b")
	taskX = uuid.MustParse("00000000-0000-0000-0000-000000000001")
	taskY = uuid.MustParse("00000000-0000-0000-0000-000000000002")
)

func ev(id int64, org, taskID uuid.UUID, visibility ...string) task.Event {
	return task.Event{ID: id, OrgID: org, TaskID: taskID, Type: "t", Status: task.StatusInProgress, Visibility: visibility}
}

func startHub(t *testing.T, src Source, cfg Config) *Hub {
	t.Helper()
	cfg.Encode = func(e *task.Event) ([]byte, error) { return json.Marshal(e.ID) }
	if cfg.Recheck == 0 {
		cfg.Recheck = time.Millisecond
	}
	h := NewHub(src, cfg, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return h
}

// receive reads n events from s, or fails after a second.
func receive(t *testing.T, s *Subscription, n int) []int64 {
	t.Helper()
	var ids []int64
	for len(ids) < n {
		select {
		case it, ok := <-s.Events():
			require.True(t, ok, "subscription ended: %v", s.Err())
			ids = append(ids, it.Event.ID)
		case <-time.After(time.Second):
			t.Fatalf("got %v, want %d events", ids, n)
		}
	}
	return ids
}

func requireNothing(t *testing.T, s *Subscription, within time.Duration) {
	t.Helper()
	select {
	case it := <-s.Events():
		t.Fatalf("unexpected event %d", it.Event.ID)
	case <-time.After(within):
	}
}

func TestHubWaitsAtAGapUntilItsTransactionEnds(t *testing.T) {
	src := &fakeSource{}
	src.commit(ev(1, orgA, taskX))
	h := startHub(t, src, Config{})
	sub, cursor, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	require.Equal(t, int64(1), cursor)

	// Transaction 2 took id 2 but has not committed; 3 has.
	xid := src.begin()
	src.commit(ev(3, orgA, taskY))
	h.Wake()
	requireNothing(t, sub, 50*time.Millisecond)

	src.commit(ev(2, orgA, taskX))
	src.end(xid)
	h.Wake()
	require.Equal(t, []int64{2, 3}, receive(t, sub, 2))
}

func TestHubPassesAGapWhoseTransactionRolledBack(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{})
	sub, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)

	xid := src.begin()
	src.commit(ev(2, orgA, taskY))
	h.Wake()
	requireNothing(t, sub, 30*time.Millisecond)
	src.end(xid) // id 1 never commits
	h.Wake()
	require.Equal(t, []int64{2}, receive(t, sub, 1))
}

func TestHubPassesAGapAfterTheTimeout(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{GapTimeout: 100 * time.Millisecond})
	sub, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	src.begin() // a long transaction that never ends
	src.commit(ev(2, orgA, taskY))
	start := time.Now()
	h.Wake()
	require.Equal(t, []int64{2}, receive(t, sub, 1))
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
}

func TestHubStartsOnceOlderTransactionsEnd(t *testing.T) {
	src := &fakeSource{}
	src.commit(ev(2, orgA, taskX))
	xid := src.begin() // may still commit id 1
	h := startHub(t, src, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, _, err := h.Subscribe(ctx, auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.ErrorIs(t, err, context.DeadlineExceeded, "not ready while an older transaction runs")
	src.end(xid)
	_, cursor, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	require.Equal(t, int64(2), cursor)
}

// A transaction left open (a psql session, a long batch) holds the hub's
// start no longer than a gap: after GapTimeout it starts from the newest
// event it saw.
func TestHubStartsAfterTheTimeoutBesideATransactionThatStaysOpen(t *testing.T) {
	src := &fakeSource{}
	src.commit(ev(2, orgA, taskX))
	src.begin() // never ends
	start := time.Now()
	h := startHub(t, src, Config{GapTimeout: 100 * time.Millisecond})
	_, cursor, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	require.Equal(t, int64(2), cursor)
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)
}

func TestHubDeliversOnlyWhatTheScopeAndFilterTakeIn(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{})
	subscribe := func(sc auth.Scope, f task.EventFilter) *Subscription {
		s, _, err := h.Subscribe(context.Background(), sc, f)
		require.NoError(t, err)
		return s
	}
	orgWide := subscribe(auth.Scope{OrgID: orgA}, task.EventFilter{})
	seer := subscribe(auth.Scope{OrgID: orgA, Roles: []string{"seers"}}, task.EventFilter{})
	admin := subscribe(auth.Scope{OrgID: orgA, SeeAll: true}, task.EventFilter{})
	oneTask := subscribe(auth.Scope{OrgID: orgA}, task.EventFilter{TaskID: taskY})
	other := subscribe(auth.Scope{OrgID: orgB}, task.EventFilter{})

	src.commit(ev(1, orgA, taskX, "seers"), ev(2, orgA, taskY), ev(3, orgB, taskX), ev(4, orgA, taskX, "others"))
	h.Wake()
	require.Equal(t, []int64{2}, receive(t, orgWide, 1))
	require.Equal(t, []int64{1, 2}, receive(t, seer, 2))
	require.Equal(t, []int64{1, 2, 4}, receive(t, admin, 3))
	require.Equal(t, []int64{2}, receive(t, oneTask, 1))
	require.Equal(t, []int64{3}, receive(t, other, 1))
	for _, s := range []*Subscription{orgWide, seer, admin, oneTask, other} {
		requireNothing(t, s, 10*time.Millisecond)
	}
}

// With no subscriber, wake-ups cost no read; the first subscriber brings
// the cursor up to date before it is registered, so its stream starts with
// the events written after it subscribed, none before.
func TestHubIdleSkipsWakeUpsAndCatchesUpForASubscriber(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{Poll: time.Hour})
	_, err := h.Cursor(context.Background())
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond) // the first read, right after settling
	src.mu.Lock()
	before := src.reads
	src.mu.Unlock()

	for i := int64(1); i <= 5; i++ {
		src.commit(ev(i, orgA, taskX))
		h.Wake()
		time.Sleep(5 * time.Millisecond)
	}
	src.mu.Lock()
	require.Equal(t, before, src.reads, "no subscriber: the wake-ups read nothing")
	src.mu.Unlock()

	requireStreamStartsAfter(t, h, src, 5)
}

// The first subscriber after a burst of events written while no one
// subscribed starts at the newest event without reading the burst, which
// is sent to no one: reading it page by page could outlast the wait of the
// subscriber's request (its client was told to try again).
func TestHubCatchesUpForASubscriberWithoutReadingTheBurstBeforeIt(t *testing.T) {
	src := &fakeSource{}
	const pageSize, burst = 10, 2000
	h := startHub(t, src, Config{Poll: time.Hour, PageSize: pageSize})
	_, err := h.Cursor(context.Background())
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond) // the first pass, right after settling
	events := make([]task.Event, burst)
	for i := range events {
		events[i] = ev(int64(i+1), orgA, taskX)
	}
	src.commit(events...)
	src.mu.Lock()
	before := src.reads
	src.mu.Unlock()

	requireStreamStartsAfter(t, h, src, burst)
	src.mu.Lock()
	defer src.mu.Unlock()
	require.Less(t, src.reads-before, burst/pageSize/10, "the burst was read, page by page")
}

// A transaction left open keeps the first subscriber's catch-up from
// jumping past what it may still write: the hub reads the events instead,
// and waits at the gap.
func TestHubCatchUpForASubscriberDoesNotJumpAnOpenTransaction(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{Poll: time.Hour, GapTimeout: time.Hour})
	_, err := h.Cursor(context.Background())
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond) // the first pass, right after settling
	xid := src.begin()                // it will write id 1
	src.commit(ev(2, orgA, taskX))
	s, at, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	require.Zero(t, at, "the cursor passed an id a running transaction may still write")
	src.commit(ev(1, orgA, taskX))
	src.end(xid)
	h.Wake()
	require.Equal(t, []int64{1, 2}, receive(t, s, 2))
}

// requireStreamStartsAfter subscribes to org A and checks that the stream
// starts after the event cursor, the newest: it gets the next event and
// nothing before it.
func requireStreamStartsAfter(t *testing.T, h *Hub, src *fakeSource, cursor int64) {
	t.Helper()
	s, at, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	require.Equal(t, cursor, at, "the subscriber's stream starts now")
	src.commit(ev(cursor+1, orgA, taskX))
	h.Wake()
	require.Equal(t, []int64{cursor + 1}, receive(t, s, 1))
	requireNothing(t, s, 10*time.Millisecond)
}

func TestHubIdleMovesItsCursorWithoutReadingEvents(t *testing.T) {
	src := &fakeSource{}
	src.commit(ev(1, orgA, taskX), ev(2, orgA, taskX), ev(3, orgA, taskX))
	h := startHub(t, src, Config{Poll: 5 * time.Millisecond})
	cursor := func() int64 {
		c, err := h.Cursor(context.Background())
		require.NoError(t, err)
		return c
	}
	require.Equal(t, int64(3), cursor())

	// Id 4 belongs to a transaction still running: the cursor may not pass
	// it, though 5 is committed.
	xid := src.begin()
	src.commit(ev(5, orgA, taskX))
	time.Sleep(50 * time.Millisecond)
	require.Equal(t, int64(3), cursor(), "a transaction that may still write id 4 is running")
	src.end(xid)
	require.Eventually(t, func() bool { return cursor() == 5 }, time.Second, time.Millisecond)
	src.mu.Lock()
	require.Zero(t, src.reads, "no subscriber: no event was read")
	src.mu.Unlock()

	requireStreamStartsAfter(t, h, src, 5)
}

func TestHubDropsASubscriberThatFallsBehind(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{Buffer: 2})
	slow, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	fast, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)

	for id := int64(1); id <= 3; id++ {
		src.commit(ev(id, orgA, taskX))
		h.Wake()
		require.Equal(t, []int64{id}, receive(t, fast, 1), "a slow subscriber never holds up another")
	}
	var ids []int64
	for it := range slow.Events() {
		ids = append(ids, it.Event.ID)
	}
	require.Equal(t, []int64{1, 2}, ids, "the slow one keeps what fitted, then ends")
	require.ErrorIs(t, slow.Err(), ErrLagged)
}

func TestHubEncodesEachEventOnce(t *testing.T) {
	src := &fakeSource{}
	var encodes int
	var mu sync.Mutex
	h := NewHub(src, Config{Recheck: time.Millisecond, Encode: func(e *task.Event) ([]byte, error) {
		mu.Lock()
		defer mu.Unlock()
		encodes++
		return json.Marshal(e.ID)
	}}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = h.Run(ctx) }()
	var subs []*Subscription
	for range 10 {
		s, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
		require.NoError(t, err)
		subs = append(subs, s)
	}
	src.commit(ev(1, orgA, taskX))
	h.Wake()
	for _, s := range subs {
		it := <-s.Events()
		b, err := it.Encoded()
		require.NoError(t, err)
		require.Equal(t, "1", string(b))
	}
	require.Equal(t, 1, encodes)
}

func TestHubEndsEverySubscriptionWhenItStops(t *testing.T) {
	src := &fakeSource{}
	h := NewHub(src, Config{Recheck: time.Millisecond}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = h.Run(ctx) }()
	s, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{TaskID: taskX})
	require.NoError(t, err)
	cancel()
	<-done
	_, open := <-s.Events()
	require.False(t, open)
	require.ErrorIs(t, s.Err(), ErrClosed)
	_, _, err = h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.ErrorIs(t, err, ErrClosed)
}

// A transaction left open (a psql session, a long batch) holds an idle
// hub's cursor no longer than a gap: after GapTimeout the cursor passes
// it, so that a stream opened later starts now and its first subscriber
// does not read, nor get, everything written since that transaction began.
func TestHubIdlePassesATransactionThatStaysOpenAfterTheTimeout(t *testing.T) {
	src := &fakeSource{}
	src.commit(ev(1, orgA, taskX))
	h := startHub(t, src, Config{Poll: 5 * time.Millisecond, GapTimeout: 50 * time.Millisecond})
	_, err := h.Cursor(context.Background())
	require.NoError(t, err)

	src.begin() // never ends
	// Id 2 was rolled back; 3 to 5 commit while the transaction stays open.
	src.commit(ev(3, orgA, taskX), ev(4, orgA, taskX), ev(5, orgA, taskX))
	require.Eventually(t, func() bool {
		c, err := h.Cursor(context.Background())
		require.NoError(t, err)
		return c == 5
	}, 2*time.Second, time.Millisecond, "the idle hub's cursor is held by a transaction left open")
	src.mu.Lock()
	require.Zero(t, src.reads, "no subscriber: no event was read")
	src.mu.Unlock()
	requireStreamStartsAfter(t, h, src, 5)
}

// A transaction the hub passed after the gap timeout may still commit an
// event it will never deliver: LateEnded changes once that transaction
// ended, so that a stream that must not miss it reads the database again.
func TestHubSaysWhenATransactionItPassedEnded(t *testing.T) {
	src := &fakeSource{}
	h := startHub(t, src, Config{GapTimeout: 50 * time.Millisecond})
	sub, _, err := h.Subscribe(context.Background(), auth.Scope{OrgID: orgA}, task.EventFilter{})
	require.NoError(t, err)
	before := h.LateEnded()

	xid := src.begin() // holds id 1
	src.commit(ev(2, orgA, taskY))
	h.Wake()
	require.Equal(t, []int64{2}, receive(t, sub, 1))
	require.Equal(t, before, h.LateEnded(), "the passed transaction still runs")

	src.commit(ev(1, orgA, taskX)) // behind the cursor: not delivered
	src.end(xid)
	deadline := time.Now().Add(5 * time.Second)
	for h.LateEnded() == before {
		require.True(t, time.Now().Before(deadline), "LateEnded did not change")
		h.Wake()
		time.Sleep(5 * time.Millisecond)
	}
	requireNothing(t, sub, 20*time.Millisecond)
}
