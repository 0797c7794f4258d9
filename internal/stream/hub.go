// Package stream fans task events out to the API's live streams.
//
// One Hub per API instance reads every committed event once, in id order,
// and hands it to each subscriber whose scope and filter take it in: the
// database answers one query per wake-up however many clients watch. A
// wake-up is a NOTIFY on the events channel (writers send it after they
// commit), backed by a slow poll.
//
// Event ids come from a sequence, so they are handed out in the order
// transactions ask for them, not the order they commit: id 7 may become
// visible after id 8. The hub therefore moves its cursor only over a gap-free
// prefix. At a gap it notes the transactions that were running when it saw
// the gap — the gap's owner, if any, is among them, because every event is
// written after its task row, once the transaction already has an id — and
// waits until all of them have finished: then the missing ids either showed
// up or never will (a rollback). Every id at or below the cursor is thus
// settled, which is what lets a client resume after any id it was sent with
// no gap and no duplicate: the catch-up reads (last sent, cursor] from the
// database and the hub delivers everything after the cursor.
package stream

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Source is where the hub reads events: postgres.EventFeed.
type Source interface {
	// Head returns the newest committed event id and the snapshot it was
	// read in.
	Head(ctx context.Context) (int64, postgres.Snapshot, error)
	// Read returns up to limit events after the id after, oldest first,
	// and the snapshot they were read in.
	Read(ctx context.Context, after int64, limit int) ([]task.Event, postgres.Snapshot, error)
}

// Config tunes a hub. Zero fields take the defaults.
type Config struct {
	// Poll is how often the hub reads without a wake-up (default 1s).
	Poll time.Duration
	// Recheck is how soon it reads again while a gap is open (default 5ms).
	Recheck time.Duration
	// GapTimeout is how long a gap may hold the stream before the hub
	// passes it anyway (default 10s). A gap lasts as long as the longest
	// transaction that was running when it appeared, whatever that
	// transaction writes; past the timeout an event that commits later is
	// not delivered (it stays in the history; LateEnded says when to read
	// it). An idle hub's cursor moves past such a transaction after the
	// same time.
	GapTimeout time.Duration
	// PageSize is the most events one read returns (default 1000).
	PageSize int
	// Buffer is how many events a subscriber may have waiting before it
	// is dropped as too slow (default 1024).
	Buffer int
	// Encode turns an event into the bytes every subscriber sends; it
	// runs at most once per event, when a subscriber first asks.
	Encode func(*task.Event) ([]byte, error)
}

func (c Config) withDefaults() Config {
	if c.Poll <= 0 {
		c.Poll = time.Second
	}
	if c.Recheck <= 0 {
		c.Recheck = 5 * time.Millisecond
	}
	if c.GapTimeout <= 0 {
		c.GapTimeout = 10 * time.Second
	}
	if c.PageSize <= 0 {
		c.PageSize = 1000
	}
	if c.Buffer <= 0 {
		c.Buffer = 1024
	}
	return c
}

// Why a subscription ends.
var (
	// ErrLagged: the subscriber fell Buffer events behind. It resumes
	// from the last event it sent.
	ErrLagged = errors.New("stream: the client fell too far behind")
	// ErrClosed: the hub stopped (the API is shutting down).
	ErrClosed = errors.New("stream: the server is shutting down")
)

// Hub reads the events and fans them out.
type Hub struct {
	src     Source
	cfg     Config
	log     *slog.Logger
	metrics *metrics

	wake  chan struct{}
	ready chan struct{} // closed once the cursor is settled
	// While no one subscribes, wake-ups are skipped and the hub does not
	// read the events at all: at each poll it moves the cursor to the
	// newest event it saw at an earlier poll, once that one is settled or
	// has waited GapTimeout (jump). skipped is set meanwhile; a new
	// subscriber first asks, on catchUp, for a read that brings the cursor
	// up to date.
	skipped atomic.Bool
	jump    *jump
	catchUp chan chan struct{}
	stopped chan struct{} // closed when Run returns

	mu     sync.Mutex
	cursor int64 // every id up to it is settled and was delivered
	byOrg  map[uuid.UUID]map[*Subscription]struct{}
	byTask map[uuid.UUID]map[*Subscription]struct{}
	closed bool

	gap *gap // the gap the cursor waits at, if any
	// late are the transactions that were still running when the cursor
	// passed ids after GapTimeout: what they commit is never delivered.
	// lateEnded counts the reads that saw some of them finished.
	late      []uint64
	lateEnded atomic.Uint64
}

// jump is where an idle hub's cursor goes next: the newest event id when it
// was read, settled once the transactions then running have finished, or
// taken anyway after GapTimeout, as a gap is.
type jump struct {
	to    int64
	xip   []uint64
	since time.Time
}

// gap is a missing id right after the cursor, and the transactions that
// were running when the hub first saw it.
type gap struct {
	at    int64
	xip   []uint64
	since time.Time
}

// NewHub returns a hub reading src. reg, when not nil, gets its metrics.
func NewHub(src Source, cfg Config, log *slog.Logger, reg prometheus.Registerer) *Hub {
	return &Hub{src: src, cfg: cfg.withDefaults(), log: log, metrics: newMetrics(reg),
		wake: make(chan struct{}, 1), ready: make(chan struct{}),
		catchUp: make(chan chan struct{}), stopped: make(chan struct{}),
		byOrg: map[uuid.UUID]map[*Subscription]struct{}{}, byTask: map[uuid.UUID]map[*Subscription]struct{}{}}
}

// Wake asks the hub to read soon. It never blocks.
func (h *Hub) Wake() {
	select {
	case h.wake <- struct{}{}:
	default:
	}
}

// Run reads and fans out until ctx is done, then ends every subscription
// with ErrClosed.
func (h *Hub) Run(ctx context.Context) error {
	defer h.close()
	if err := h.settle(ctx); err != nil {
		return nil //nolint:nilerr // settle fails only when ctx is done
	}
	// After an error, and while a gap holds, read again soon, then less
	// and less often.
	backoff := h.cfg.Recheck
	var asked chan struct{}
	for {
		wait := h.cfg.Poll
		var blocked bool
		var err error
		if asked == nil && h.idle() {
			h.skipped.Store(true)
			err = h.skipAhead(ctx)
		} else {
			h.skipped.Store(false)
			if asked != nil && h.idle() {
				err = h.skipToHead(ctx)
			}
			if err == nil {
				blocked, err = h.step(ctx)
			}
		}
		if asked != nil {
			close(asked)
		}
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			h.log.WarnContext(ctx, "stream: reading events", "error", err, "retry_in", backoff)
			wait, backoff = backoff, min(backoff*2, 5*time.Second)
		case blocked:
			wait, backoff = backoff, min(backoff*2, 200*time.Millisecond)
		default:
			backoff = h.cfg.Recheck
		}
		if asked = h.sleep(ctx, wait); ctx.Err() != nil {
			return nil
		}
	}
}

// sleep waits for the next read: a wake-up while anyone subscribes, a
// subscriber's request (returned, to be closed after the read), or wait.
// A wake-up with no subscriber is noted and skipped: on an API no client
// watches, reading each event as it commits would be a query per write
// for no one.
func (h *Hub) sleep(ctx context.Context, wait time.Duration) (asked chan struct{}) {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
			return nil
		case asked := <-h.catchUp:
			return asked
		case <-h.wake:
			if !h.idle() {
				return nil
			}
			h.skipped.Store(true)
		}
	}
}

// idle reports whether no one subscribes.
func (h *Hub) idle() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.byOrg) == 0 && len(h.byTask) == 0
}

// catchUpFor brings the cursor up to date when wake-ups were skipped, so
// that a new subscriber's stream starts now, not at the last poll.
func (h *Hub) catchUpFor(ctx context.Context) error {
	if !h.skipped.Load() {
		return nil
	}
	done := make(chan struct{})
	select {
	case h.catchUp <- done:
	case <-h.stopped:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-done:
		return nil
	case <-h.stopped:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

// skipAhead moves the cursor of a hub no one subscribes to without reading
// the events it passes, which no one would be sent: to the newest id read
// at an earlier call, once every transaction then running has finished (or
// GapTimeout has passed), and then notes the newest id now. A burn-down of
// tasks writes thousands of events a second; reading each to hand it to no
// one cost the API a tenth of a core, and PostgreSQL as much.
//
// A jump still waiting is kept rather than replaced by a newer one: each
// poll's transactions include any that stays open, so a jump replaced at
// every poll would never settle while a psql session or a long batch holds
// a transaction open, and the first subscriber after it would have to read,
// and would be sent as new, everything written since.
func (h *Hub) skipAhead(ctx context.Context) error {
	head, snap, err := h.src.Head(ctx)
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.endLate(snap)
	if len(h.byOrg) > 0 || len(h.byTask) > 0 {
		// A subscriber came meanwhile: it is sent every event after the
		// cursor, which must not move past one it has not been sent.
		return nil
	}
	if j := h.jump; j != nil && j.to > h.cursor {
		switch {
		case snap.Finished(j.xip):
		case time.Since(j.since) >= h.cfg.GapTimeout:
			h.metrics.gaps.WithLabelValues("timed_out").Inc()
			h.log.Info("stream: idle, moving the cursor past transactions that may still write older events",
				"from", h.cursor, "to", j.to, "waited", time.Since(j.since))
			h.noteLate(j.xip)
		default:
			return nil
		}
		h.cursor, h.gap = j.to, nil
	}
	h.jump = &jump{to: head, xip: snap.Xip, since: time.Now()}
	return nil
}

// skipToHeadWait bounds how long a new subscriber's catch-up waits for
// the transactions running at the newest event to finish, before it reads
// the events instead.
const skipToHeadWait = 500 * time.Millisecond

// skipToHead moves the cursor of a hub no one subscribes to yet (a
// subscriber waits for it, on catchUp) to the newest event, once every
// transaction that may still write an older one has finished: the events
// it passes are sent to no one, and reading them, up to a poll's worth or
// more after a burst, could outlast the subscriber's wait. The cursor
// stays where it is when those transactions do not finish within
// skipToHeadWait (one left open, say): step reads from there, and passes
// each gap on its own.
func (h *Hub) skipToHead(ctx context.Context) error {
	head, snap, err := h.src.Head(ctx)
	if err != nil {
		return err
	}
	barrier := snap.Xip
	deadline := time.Now().Add(min(skipToHeadWait, h.cfg.GapTimeout))
	wait := h.cfg.Recheck
	for {
		_, snap, err := h.src.Head(ctx)
		if err != nil {
			return err
		}
		if snap.Finished(barrier) {
			break
		}
		if time.Now().Add(wait).After(deadline) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(wait*2, 50*time.Millisecond)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	// A subscriber registered meanwhile is sent every event after the
	// cursor, which must not move past one it has not been sent.
	if len(h.byOrg) == 0 && len(h.byTask) == 0 && head > h.cursor {
		h.cursor, h.gap = head, nil
	}
	return nil
}

// settle starts the cursor at the newest event, once every transaction
// that may still commit an older one has finished, or after GapTimeout, as
// a gap would be passed: a transaction left open (a psql session, a long
// batch) must not keep the streams from starting. It reads again at the
// pace of Run's gaps, backing off to 200ms, and to 5s while reads fail.
func (h *Hub) settle(ctx context.Context) error {
	var barrier []uint64
	var since time.Time
	first := true
	wait := h.cfg.Recheck
	for {
		head, snap, err := h.src.Head(ctx)
		switch {
		case err != nil:
			h.log.WarnContext(ctx, "stream: reading the newest event", "error", err, "retry_in", wait)
		case first:
			h.cursor, barrier, first, since = head, snap.Xip, false, time.Now()
			continue
		case snap.Finished(barrier):
			close(h.ready)
			return nil
		case time.Since(since) >= h.cfg.GapTimeout:
			h.metrics.gaps.WithLabelValues("timed_out").Inc()
			h.log.Warn("stream: starting after waiting for transactions that may still write older events",
				"cursor", h.cursor, "waited", time.Since(since))
			h.mu.Lock()
			h.noteLate(barrier)
			h.mu.Unlock()
			close(h.ready)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		if err != nil {
			wait = min(wait*2, 5*time.Second)
		} else {
			wait = min(wait*2, 200*time.Millisecond)
		}
	}
}

// step reads and delivers until it has caught up; blocked means a gap
// holds the cursor.
func (h *Hub) step(ctx context.Context) (blocked bool, err error) {
	for {
		events, snap, err := h.src.Read(ctx, h.cursor, h.cfg.PageSize)
		if err != nil {
			return false, err
		}
		if blocked := h.deliver(events, snap); blocked {
			return true, nil
		}
		if len(events) < h.cfg.PageSize {
			return false, h.checkLate(ctx, len(events) > 0)
		}
	}
}

// deliver hands out events in id order up to the first gap that may still
// fill.
func (h *Hub) deliver(events []task.Event, snap postgres.Snapshot) (blocked bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(events) > 0 {
		h.endLate(snap)
	}
	for i := range events {
		e := &events[i]
		if e.ID != h.cursor+1 && !h.gapPassed(e.ID, snap) {
			return true
		}
		h.dispatch(e)
		h.cursor = e.ID
	}
	return false
}

// noteLate adds xids to the transactions whose events the cursor passed;
// h.mu is held.
func (h *Hub) noteLate(xids []uint64) {
	for _, x := range xids {
		if !slices.Contains(h.late, x) {
			h.late = append(h.late, x)
		}
	}
}

// endLate drops the late transactions that snap saw finished, and counts
// the drop in LateEnded; h.mu is held.
func (h *Hub) endLate(snap postgres.Snapshot) {
	n := len(h.late)
	h.late = slices.DeleteFunc(h.late, func(x uint64) bool { return snap.Finished([]uint64{x}) })
	if len(h.late) < n {
		h.lateEnded.Add(1)
	}
}

// checkLate sees whether late transactions finished after a read that
// found no event, and so brought no snapshot: a quiet hub would otherwise
// never see them end.
func (h *Hub) checkLate(ctx context.Context, read bool) error {
	h.mu.Lock()
	pending := len(h.late) > 0
	h.mu.Unlock()
	if !pending || read {
		return nil
	}
	_, snap, err := h.src.Head(ctx)
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.endLate(snap)
	return nil
}

// LateEnded changes whenever transactions that were still running when
// the cursor passed them (after GapTimeout) are seen finished: what they
// committed was not delivered, and a stream that must not miss it reads
// it from the database then.
func (h *Hub) LateEnded() uint64 { return h.lateEnded.Load() }

// gapPassed reports whether the ids between the cursor and next are
// settled: all the transactions running when the gap was first seen have
// finished (snap is newer, and the ids are still missing from it), or the
// gap has waited GapTimeout.
func (h *Hub) gapPassed(next int64, snap postgres.Snapshot) bool {
	if h.gap == nil || h.gap.at != h.cursor+1 {
		h.gap = &gap{at: h.cursor + 1, xip: snap.Xip, since: time.Now()}
	}
	switch {
	case snap.Finished(h.gap.xip):
		h.metrics.gaps.WithLabelValues("settled").Inc()
	case time.Since(h.gap.since) >= h.cfg.GapTimeout:
		h.metrics.gaps.WithLabelValues("timed_out").Inc()
		h.log.Warn("stream: passing a gap in the event ids after waiting for it",
			"from", h.gap.at, "to", next-1, "waited", time.Since(h.gap.since))
		h.noteLate(h.gap.xip)
	default:
		return false
	}
	h.gap = nil
	return true
}

// dispatch offers e to every subscriber it is for. A subscriber whose
// buffer is full is dropped, never waited for.
func (h *Hub) dispatch(e *task.Event) {
	h.metrics.events.Inc()
	var item *Item
	offer := func(subs map[*Subscription]struct{}) {
		for s := range subs {
			if !s.scope.Sees(e.OrgID, e.Visibility) || !s.filter.Match(e) {
				continue
			}
			if item == nil {
				item = &Item{Event: *e, encode: h.cfg.Encode}
			}
			select {
			case s.ch <- item:
			default:
				h.metrics.dropped.Inc()
				h.end(s, ErrLagged)
			}
		}
	}
	offer(h.byTask[e.TaskID])
	offer(h.byOrg[e.OrgID])
}

// GapHeld reports whether a gap in the ids holds the cursor now, and the
// longest one may: another instance's hub may have passed a gap this one
// still waits at, for up to that long.
func (h *Hub) GapHeld() (held bool, longest time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.gap != nil, h.cfg.GapTimeout
}

// Cursor waits until the hub is ready and returns its cursor: every event
// up to it is settled in the database.
func (h *Hub) Cursor(ctx context.Context) (int64, error) {
	if err := h.waitReady(ctx); err != nil {
		return 0, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return 0, ErrClosed
	}
	return h.cursor, nil
}

func (h *Hub) waitReady(ctx context.Context) error {
	select {
	case <-h.ready:
		return nil
	case <-h.stopped:
		// Stopped before it was ready: it never will be.
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Subscribe registers a subscriber for the events of scope that pass f,
// and returns the cursor: the subscription receives every such event after
// it, and none at or before it. It waits until the hub is ready.
func (h *Hub) Subscribe(ctx context.Context, scope auth.Scope, f task.EventFilter) (*Subscription, int64, error) {
	if err := h.waitReady(ctx); err != nil {
		return nil, 0, err
	}
	if err := h.catchUpFor(ctx); err != nil {
		return nil, 0, err
	}
	s := &Subscription{hub: h, scope: scope, filter: f, ch: make(chan *Item, h.cfg.Buffer)}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, 0, ErrClosed
	}
	index, key := h.byOrg, scope.OrgID
	if f.TaskID != uuid.Nil {
		index, key = h.byTask, f.TaskID
	}
	if index[key] == nil {
		index[key] = map[*Subscription]struct{}{}
	}
	index[key][s] = struct{}{}
	h.metrics.subscribers.Inc()
	return s, h.cursor, nil
}

// end removes s and closes its channel with err; h.mu is held.
func (h *Hub) end(s *Subscription, err error) {
	index, key := h.byOrg, s.scope.OrgID
	if s.filter.TaskID != uuid.Nil {
		index, key = h.byTask, s.filter.TaskID
	}
	if _, ok := index[key][s]; !ok {
		return
	}
	delete(index[key], s)
	if len(index[key]) == 0 {
		delete(index, key)
	}
	s.err = err
	close(s.ch)
	h.metrics.subscribers.Dec()
}

func (h *Hub) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	close(h.stopped)
	for _, index := range []map[uuid.UUID]map[*Subscription]struct{}{h.byOrg, h.byTask} {
		for _, subs := range index {
			for s := range subs {
				h.end(s, ErrClosed)
			}
		}
	}
}

// Subscription is one subscriber's share of the events.
type Subscription struct {
	hub    *Hub
	scope  auth.Scope
	filter task.EventFilter
	ch     chan *Item
	err    error // why ch was closed; written before the close
}

// Events delivers the subscription's events in id order. It is closed when
// the subscription ends; Err then says why.
func (s *Subscription) Events() <-chan *Item { return s.ch }

// Err is why the subscription ended: ErrLagged, ErrClosed, or nil after
// Close. Call it once Events is closed.
func (s *Subscription) Err() error { return s.err }

// Close ends the subscription.
func (s *Subscription) Close() {
	s.hub.mu.Lock()
	defer s.hub.mu.Unlock()
	s.hub.end(s, nil)
}

// Item is one event as the hub delivers it: shared by every subscriber,
// and encoded once for all of them.
type Item struct {
	Event  task.Event
	encode func(*task.Event) ([]byte, error)
	once   sync.Once
	data   []byte
	err    error
}

// Encoded is the event as the hub's Encode makes it, computed on first use.
func (it *Item) Encoded() ([]byte, error) {
	it.once.Do(func() {
		if it.encode == nil {
			it.err = errors.New("stream: the hub has no encoder")
			return
		}
		it.data, it.err = it.encode(&it.Event)
	})
	return it.data, it.err
}

type metrics struct {
	subscribers prometheus.Gauge
	events      prometheus.Counter
	dropped     prometheus.Counter
	gaps        *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		subscribers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_stream_subscribers", Help: "Open live streams of this API instance."}),
		events: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "conveyor_stream_events_total", Help: "Task events the stream hub read and fanned out."}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "conveyor_stream_dropped_total",
			Help: "Streams closed because their client fell too far behind (it resumes with Last-Event-ID)."}),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_stream_gaps_total",
			Help: "Gaps in the event ids the hub passed: settled (their transactions ended) or timed_out."},
			[]string{"outcome"}),
	}
	if reg != nil {
		reg.MustRegister(m.subscribers, m.events, m.dropped, m.gaps)
	}
	return m
}
