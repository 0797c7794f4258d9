// Package relay publishes committed outbox rows to the broker: woken by
// NOTIFY, backed by a poll, with publisher confirms, reconnecting to a lost
// broker or database. Any number of relays may run at once, and one relay
// keeps several batches in flight (its lanes). A message no queue takes
// (its type has no worker yet) is parked in the outbox until a worker for
// the type declares its queue.
package relay

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/wait"
)

// Store is the outbox as the relay needs it.
type Store interface {
	Relay(ctx context.Context, limit int, publish func(context.Context, []outbox.Message) outbox.Outcome) (int, error)
	Stats(ctx context.Context) (outbox.Stats, error)
	// Unpark releases the rows parked for types and says how many.
	Unpark(ctx context.Context, types []string) (int64, error)
	Ping(ctx context.Context) error
}

// Broker connects publishers.
type Broker interface {
	// Publisher opens a confirming publisher that can take batches of up
	// to batchSize messages.
	Publisher(ctx context.Context, batchSize int) (Publisher, error)
}

// BrokerFunc adapts a function to Broker.
type BrokerFunc func(ctx context.Context, batchSize int) (Publisher, error)

// Publisher calls f.
func (f BrokerFunc) Publisher(ctx context.Context, batchSize int) (Publisher, error) {
	return f(ctx, batchSize)
}

// Publisher publishes batches on one broker connection.
type Publisher interface {
	// Publish sends msgs and says which the broker confirmed, which no
	// queue took, and which failed.
	Publish(ctx context.Context, msgs []outbox.Message) outbox.Outcome
	// Route names where a message goes: the exchange and routing key.
	Route(m outbox.Message) (exchange, routingKey string)
	// HasQueue reports whether a worker has declared the queue of
	// taskType's messages; false when it cannot tell before ctx ends.
	HasQueue(ctx context.Context, taskType string) bool
	// Blocked reports a resource alarm: the broker holds publishers back.
	Blocked() bool
	// Done is closed when the connection is gone; Err says why.
	Done() <-chan struct{}
	Err() error
	Close() error
}

// Config tunes a relay.
type Config struct {
	BatchSize           int
	PollInterval        time.Duration
	ConfirmTimeout      time.Duration
	ReconnectBackoffMax time.Duration
	StatsInterval       time.Duration
	// Lanes is how many batches the relay keeps in flight at once, each
	// on its own broker connection (at least one).
	Lanes int
	// ShutdownTimeout bounds how long the batches in flight when Run's
	// context ends may still take (SHUTDOWN_TIMEOUT); 0: only the confirm
	// timeout bounds them.
	ShutdownTimeout time.Duration
}

// Relay moves outbox rows to the broker.
type Relay struct {
	cfg        Config
	store      Store
	log        *slog.Logger
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	metrics    *Metrics
	broker     Broker
	lanes      []lane
	connected  atomic.Int32
	// hard ends the batches in flight: ShutdownTimeout after Run's
	// context. Set by Run before its lanes start.
	hard context.Context
}

// A lane relays one batch at a time on its own broker connection. A batch
// is three steps one after another: lock the rows, publish them and wait
// for the broker's confirms, delete the rows and commit. Lanes overlap
// them: a lane that locked a full batch wakes the next lane before it
// publishes, and that lane locks the following batch (the lock skips the
// rows another lane holds) while the first waits for its confirms. A
// NOTIFY wakes one lane, the first connected one that is not in a pass, so
// a trickle of rows costs one pass per wake-up, as with one lane, and a row
// committed while a lane waits for the broker's confirms goes out at once
// on another instead of waiting behind them.
type lane struct {
	wake chan struct{}
	pub  atomic.Pointer[Publisher]
	// busy is set while the lane makes a pass over the outbox.
	busy atomic.Bool
	// blocked is what the lane last learnt of its connection: the broker
	// blocks it (a resource alarm).
	blocked atomic.Bool
}

// Deps are a relay's collaborators.
type Deps struct {
	Store          Store
	Broker         Broker
	Log            *slog.Logger
	TracerProvider trace.TracerProvider
	Propagator     propagation.TextMapPropagator
	Metrics        *Metrics
}

// New returns a relay.
func New(cfg Config, deps Deps) *Relay {
	r := &Relay{
		cfg: cfg, store: deps.Store, broker: deps.Broker, log: deps.Log, metrics: deps.Metrics,
		propagator: deps.Propagator,
		tracer:     deps.TracerProvider.Tracer("github.com/conveyorhq/conveyor/internal/relay"),
		lanes:      make([]lane, max(cfg.Lanes, 1)),
	}
	for i := range r.lanes {
		r.lanes[i].wake = make(chan struct{}, 1)
	}
	return r
}

// Wake asks for a pass over the outbox now: of the first lane that holds
// a live broker connection and is not in a pass, else of the first that
// holds one (it passes again when its pass ends), else of the last (it
// passes once it has one). It never blocks.
func (r *Relay) Wake() {
	first := -1
	for i := range r.lanes {
		if !r.lanes[i].live() {
			continue
		}
		if !r.lanes[i].busy.Load() {
			r.wakeLane(i)
			return
		}
		if first < 0 {
			first = i
		}
	}
	if first < 0 {
		first = len(r.lanes) - 1
	}
	r.wakeLane(first)
}

func (r *Relay) wakeLane(i int) {
	select {
	case r.lanes[i].wake <- struct{}{}:
	default:
	}
}

// live reports whether the lane holds a broker connection that is open.
func (l *lane) live() bool {
	p := l.pub.Load()
	if p == nil {
		return false
	}
	select {
	case <-(*p).Done():
		return false
	default:
		return true
	}
}

// Ready reports whether the relay can publish: every lane connected to the
// broker and the database reachable. blocked says whether the broker is
// holding publishers back with a resource alarm (the relay is healthy;
// rows wait).
func (r *Relay) Ready(ctx context.Context) (ready, blocked bool, err error) {
	for i := range r.lanes {
		if !r.lanes[i].live() {
			return false, false, nil
		}
		blocked = blocked || (*r.lanes[i].pub.Load()).Blocked()
	}
	if err := r.store.Ping(ctx); err != nil {
		return false, blocked, err
	}
	return true, blocked, nil
}

// Run relays until ctx is done. The batches in flight when ctx ends are
// finished (published and their rows deleted) before Run returns.
func (r *Relay) Run(ctx context.Context) error {
	hard, cancelHard := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHard()
	if r.cfg.ShutdownTimeout > 0 {
		stop := context.AfterFunc(ctx, func() {
			t := time.AfterFunc(r.cfg.ShutdownTimeout, cancelHard)
			context.AfterFunc(hard, func() { t.Stop() })
		})
		defer stop()
	}
	r.hard = hard
	go r.measure(ctx)
	var wg sync.WaitGroup
	for i := range r.lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.runLane(ctx, i)
		}()
	}
	wg.Wait()
	return nil
}

// runLane connects lane i to the broker, again whenever it loses the
// connection, and relays on it until ctx is done.
func (r *Relay) runLane(ctx context.Context, i int) {
	b := wait.Backoff(100*time.Millisecond, r.cfg.ReconnectBackoffMax)
	for ctx.Err() == nil {
		pub, err := r.broker.Publisher(ctx, r.cfg.BatchSize)
		if err != nil {
			retry := b.NextBackOff()
			// The error says what failed (the network, the login, the
			// vhost, TLS): the headline does not guess.
			r.log.WarnContext(ctx, "cannot connect to the broker; retrying", "lane", i, "error", err, "retry_in", retry)
			wait.Sleep(ctx, retry)
			continue
		}
		b.Reset()
		r.lanes[i].pub.Store(&pub)
		r.metrics.connected.Set(float64(r.connected.Add(1)))
		r.log.InfoContext(ctx, "connected to broker", "lane", i)
		r.serve(ctx, i, pub)
		r.metrics.connected.Set(float64(r.connected.Add(-1)))
		r.setBlocked(i, false)
		_ = pub.Close()
	}
}

// serve relays on lane i's broker connection until it closes or ctx ends.
func (r *Relay) serve(ctx context.Context, i int, pub Publisher) {
	ticker := time.NewTicker(r.cfg.PollInterval)
	defer ticker.Stop()
	r.wakeLane(i) // catch up on what was committed while disconnected
	dbBackoff := wait.Backoff(100*time.Millisecond, r.cfg.ReconnectBackoffMax)
	for {
		select {
		case <-ctx.Done():
			return
		case <-pub.Done():
			r.log.WarnContext(ctx, "broker connection lost; reconnecting", "lane", i, "error", pub.Err())
			return
		case <-r.lanes[i].wake:
		case <-ticker.C:
		}
		if err := pub.Err(); err != nil {
			// Given up (a nack, a late confirm) but not closed yet: the
			// broker may be slow to answer the close, and a batch on the
			// channel meanwhile would fail or go out twice.
			r.log.WarnContext(ctx, "broker channel given up; reconnecting", "lane", i, "error", err)
			r.awaitUnblocked(ctx, i, pub)
			return
		}
		r.lanes[i].busy.Store(true)
		for ctx.Err() == nil {
			blocked := pub.Blocked()
			r.setBlocked(i, blocked)
			if blocked {
				break // rows wait in the outbox until the alarm clears
			}
			n, err := r.relayBatch(ctx, i, pub)
			if err != nil {
				retry := dbBackoff.NextBackOff()
				r.log.WarnContext(ctx, "relay batch failed; retrying", "error", err, "retry_in", retry)
				wait.Sleep(ctx, retry)
				break
			}
			dbBackoff.Reset()
			if n < r.cfg.BatchSize || pub.Err() != nil {
				break
			}
		}
		r.lanes[i].busy.Store(false)
	}
}

// awaitUnblocked holds on to lane i's given-up connection while the broker
// blocks it (a resource alarm), until the alarm clears, the connection
// closes or ctx ends. The broker reads nothing from a blocked connection:
// the batch it held up stays in its socket buffer, and goes out when the
// alarm clears, though its rows failed and will be published again. A new
// connection is blocked at its first publish too, so dialling again during
// the alarm would leave one more such batch behind, and one more set of
// duplicates, every confirm timeout.
func (r *Relay) awaitUnblocked(ctx context.Context, i int, pub Publisher) {
	if !pub.Blocked() {
		return
	}
	r.setBlocked(i, true)
	r.log.WarnContext(ctx, "broker blocks publishers (resource alarm): reconnecting once it clears", "lane", i)
	t := time.NewTicker(r.cfg.PollInterval)
	defer t.Stop()
	for pub.Blocked() {
		select {
		case <-ctx.Done():
			return
		case <-pub.Done():
			return
		case <-t.C:
		}
	}
}

// setBlocked records whether the broker blocks lane i's connection. The
// gauge says whether it blocks any lane, as /readyz does: set from each
// lane's own view alone, it followed whichever lane passed last, and read 0
// after each pass of a lane the broker had not blocked yet.
func (r *Relay) setBlocked(i int, blocked bool) {
	r.lanes[i].blocked.Store(blocked)
	blockedAny := false
	for j := range r.lanes {
		blockedAny = blockedAny || r.lanes[j].blocked.Load()
	}
	r.metrics.blocked.Set(boolGauge(blockedAny))
}

// relayBatch publishes one batch on lane i. It is not cut short by ctx: a
// stopping relay finishes the batch it started, within the confirm timeout
// and the shutdown timeout.
// A full batch wakes the next lane first: more rows are likely waiting.
func (r *Relay) relayBatch(ctx context.Context, i int, pub Publisher) (int, error) {
	parent := r.hard
	if parent == nil {
		parent = context.WithoutCancel(ctx)
	}
	bctx, cancel := context.WithTimeout(parent, r.cfg.ConfirmTimeout+5*time.Second)
	defer cancel()
	var parked []string
	n, err := r.store.Relay(bctx, r.cfg.BatchSize, func(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
		if len(msgs) == r.cfg.BatchSize && len(r.lanes) > 1 {
			r.wakeLane((i + 1) % len(r.lanes))
		}
		out := r.publish(ctx, pub, msgs)
		parked = parkedTypes(msgs, out)
		return out
	})
	if n > 0 {
		r.metrics.batchSize.Observe(float64(n))
	}
	if err == nil && len(parked) > 0 {
		r.unparkDeclared(bctx, i, pub, parked)
	}
	return n, err
}

// unparkDeclared releases the rows of a batch just parked whose type's
// queue exists now. A worker declares its queue, then releases the rows
// parked for its type; if it did both between the publisher's finding no
// queue and the commit of the park, its release did not see the rows as
// parked, and they would wait for maintenance's backstop. Asked after the
// commit, the broker either has the queue, and the relay releases them, or
// has it not, and the worker's release comes after the commit and sees
// them.
func (r *Relay) unparkDeclared(ctx context.Context, i int, pub Publisher, types []string) {
	if pub.Blocked() {
		return // the broker would not answer; maintenance releases them
	}
	hctx, cancel := context.WithTimeout(ctx, r.cfg.ConfirmTimeout)
	defer cancel()
	var ready []string
	for _, t := range types {
		if pub.HasQueue(hctx, t) {
			ready = append(ready, t)
		}
	}
	if len(ready) == 0 {
		return
	}
	n, err := r.store.Unpark(ctx, ready)
	if err != nil {
		// Maintenance releases them too; only latency is lost.
		r.log.WarnContext(ctx, "release parked messages of declared types", "types", ready, "error", err)
		return
	}
	if n > 0 {
		r.wakeLane(i)
	}
}

// parkedTypes lists the distinct types of the messages out parked.
func parkedTypes(msgs []outbox.Message, out outbox.Outcome) []string {
	var types []string
	seen := map[string]bool{}
	for _, m := range msgs {
		if _, ok := out.Unroutable[m.ID]; ok && !seen[m.TaskType] {
			seen[m.TaskType] = true
			types = append(types, m.TaskType)
		}
	}
	return types
}

// publish sends a batch, each message under a PRODUCER span that continues
// the trace of the request that wrote it.
func (r *Relay) publish(ctx context.Context, pub Publisher, msgs []outbox.Message) outbox.Outcome {
	spans := make([]trace.Span, len(msgs))
	for i := range msgs {
		msgs[i].Headers, spans[i] = r.startProducerSpan(ctx, pub, msgs[i])
	}
	cctx, cancel := context.WithTimeout(ctx, r.cfg.ConfirmTimeout)
	out := pub.Publish(cctx, msgs)
	cancel()
	r.metrics.messages.Add(float64(out.Messages))
	now := time.Now()
	for i, m := range msgs {
		if env, packed := out.Envelopes[m.ID]; packed {
			nameEnvelope(spans[i], env)
		}
		// What is logged of a message is logged in its task's trace.
		mctx := trace.ContextWithSpan(ctx, spans[i])
		if reason, failed := out.Failed[m.ID]; failed {
			endFailed(spans[i], reason)
			r.metrics.failures.Inc()
			r.log.WarnContext(mctx, "publish failed; will retry", "outbox_id", m.ID, "task_id", m.TaskID, "kind", m.Kind, "error", reason)
			continue
		}
		if reason, unroutable := out.Unroutable[m.ID]; unroutable {
			endParked(spans[i], reason)
			r.metrics.parked.Inc()
			r.log.InfoContext(mctx, "no queue for the task's type yet: parked until a worker for it starts",
				"outbox_id", m.ID, "task_id", m.TaskID, "type", m.TaskType)
			continue
		}
		spans[i].End()
		r.metrics.published.WithLabelValues(string(m.Kind)).Inc()
		// From when the row was due: a task submitted for later waited
		// for its time, not for the relay.
		r.metrics.latency.Observe(now.Sub(later(m.CreatedAt, m.DueAt)).Seconds())
	}
	return out
}

// measure samples the outbox depth and the age of its oldest due row.
func (r *Relay) measure(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for {
		// A failed sample leaves the gauges as they were: the failures
		// counter and the log say they are stale.
		if st, err := r.store.Stats(ctx); err == nil {
			r.metrics.depth.Set(float64(st.Due))
			r.metrics.oldestAge.Set(st.OldestDueAge.Seconds())
			r.metrics.parkedDepth.Set(float64(st.Parked))
		} else if ctx.Err() == nil {
			r.metrics.statsFailures.Inc()
			r.log.WarnContext(ctx, "measure the outbox: its gauges are stale", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// later is the later of two times.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
