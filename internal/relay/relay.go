// Package relay publishes committed outbox rows to RabbitMQ: woken by
// NOTIFY, backed by a poll, with publisher confirms, reconnecting to a lost
// broker or database. Any number of relays may run at once.
package relay

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v5"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

// Store is the outbox as the relay needs it.
type Store interface {
	Relay(ctx context.Context, limit int, publish func(context.Context, []outbox.Message) outbox.Outcome) (int, error)
	Stats(ctx context.Context) (outbox.Stats, error)
	Ping(ctx context.Context) error
}

// Config tunes a relay.
type Config struct {
	AMQPURL             string
	Name                string
	BatchSize           int
	PollInterval        time.Duration
	ConfirmTimeout      time.Duration
	ReconnectBackoffMax time.Duration
	StatsInterval       time.Duration
}

// Relay moves outbox rows to the broker.
type Relay struct {
	cfg        Config
	store      Store
	log        *slog.Logger
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	metrics    *Metrics
	wake       chan struct{}
	pub        atomic.Pointer[rabbitmq.Publisher]
}

// New returns a relay.
func New(cfg Config, store Store, log *slog.Logger, tp trace.TracerProvider, prop propagation.TextMapPropagator, m *Metrics) *Relay {
	return &Relay{
		cfg: cfg, store: store, log: log, metrics: m, propagator: prop,
		tracer: tp.Tracer("github.com/conveyorhq/conveyor/internal/relay"),
		wake:   make(chan struct{}, 1),
	}
}

// Wake asks for a pass over the outbox now. It never blocks.
func (r *Relay) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Ready reports whether the relay can publish: broker connected and
// database reachable. blocked says whether the broker is holding publishers
// back with a resource alarm (the relay is healthy; rows wait).
func (r *Relay) Ready(ctx context.Context) (ready, blocked bool, err error) {
	pub := r.pub.Load()
	if pub == nil {
		return false, false, nil
	}
	select {
	case <-pub.Closed():
		return false, false, nil
	default:
	}
	if err := r.store.Ping(ctx); err != nil {
		return false, pub.Blocked(), err
	}
	return true, pub.Blocked(), nil
}

// Run relays until ctx is done. A batch in flight when ctx ends is finished
// (published and its rows deleted) before Run returns.
func (r *Relay) Run(ctx context.Context) error {
	go r.measure(ctx)
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 100*time.Millisecond, r.cfg.ReconnectBackoffMax
	for ctx.Err() == nil {
		pub, err := rabbitmq.DialPublisher(r.cfg.AMQPURL, r.cfg.BatchSize, r.cfg.Name)
		if err != nil {
			wait := b.NextBackOff()
			r.log.WarnContext(ctx, "broker unreachable; retrying", "error", err, "retry_in", wait)
			sleep(ctx, wait)
			continue
		}
		b.Reset()
		r.pub.Store(pub)
		r.metrics.connected.Set(1)
		r.log.InfoContext(ctx, "connected to broker")
		r.serve(ctx, pub)
		r.metrics.connected.Set(0)
		_ = pub.Close()
	}
	return nil
}

// serve relays on one broker connection until it closes or ctx ends.
func (r *Relay) serve(ctx context.Context, pub *rabbitmq.Publisher) {
	ticker := time.NewTicker(r.cfg.PollInterval)
	defer ticker.Stop()
	r.Wake() // catch up on what was committed while disconnected
	dbBackoff := backoff.NewExponentialBackOff()
	dbBackoff.InitialInterval, dbBackoff.MaxInterval = 100*time.Millisecond, r.cfg.ReconnectBackoffMax
	for {
		select {
		case <-ctx.Done():
			return
		case <-pub.Closed():
			r.log.WarnContext(ctx, "broker connection lost; reconnecting", "error", pub.Err())
			return
		case <-r.wake:
		case <-ticker.C:
		}
		for ctx.Err() == nil {
			blocked := pub.Blocked()
			r.metrics.blocked.Set(boolGauge(blocked))
			if blocked {
				break // rows wait in the outbox until the alarm clears
			}
			n, err := r.relayBatch(ctx, pub)
			if err != nil {
				wait := dbBackoff.NextBackOff()
				r.log.WarnContext(ctx, "relay batch failed; retrying", "error", err, "retry_in", wait)
				sleep(ctx, wait)
				break
			}
			dbBackoff.Reset()
			if n < r.cfg.BatchSize || pub.Err() != nil {
				break
			}
		}
	}
}

// relayBatch publishes one batch. It is not cut short by ctx: a stopping
// relay finishes the batch it started, within the confirm timeout.
func (r *Relay) relayBatch(ctx context.Context, pub *rabbitmq.Publisher) (int, error) {
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.ConfirmTimeout+5*time.Second)
	defer cancel()
	n, err := r.store.Relay(bctx, r.cfg.BatchSize, func(ctx context.Context, msgs []outbox.Message) outbox.Outcome {
		return r.publish(ctx, pub, msgs)
	})
	if n > 0 {
		r.metrics.batchSize.Observe(float64(n))
	}
	return n, err
}

// publish sends a batch, each message under a PRODUCER span that continues
// the trace of the request that wrote it.
func (r *Relay) publish(ctx context.Context, pub *rabbitmq.Publisher, msgs []outbox.Message) outbox.Outcome {
	spans := make([]trace.Span, len(msgs))
	for i := range msgs {
		msgs[i].Headers, spans[i] = r.startProducerSpan(ctx, msgs[i])
	}
	cctx, cancel := context.WithTimeout(ctx, r.cfg.ConfirmTimeout)
	out := pub.Publish(cctx, msgs)
	cancel()
	now := time.Now()
	for i, m := range msgs {
		if reason, failed := out.Failed[m.ID]; failed {
			endFailed(spans[i], reason)
			r.metrics.failures.Inc()
			r.log.WarnContext(ctx, "publish failed; will retry", "outbox_id", m.ID, "task_id", m.TaskID, "kind", m.Kind, "error", reason)
			continue
		}
		spans[i].End()
		r.metrics.published.WithLabelValues(string(m.Kind)).Inc()
		r.metrics.latency.Observe(now.Sub(m.CreatedAt).Seconds())
	}
	return out
}

// measure samples the outbox depth and the age of its oldest due row.
func (r *Relay) measure(ctx context.Context) {
	t := time.NewTicker(r.cfg.StatsInterval)
	defer t.Stop()
	for {
		if st, err := r.store.Stats(ctx); err == nil {
			r.metrics.depth.Set(float64(st.Due))
			r.metrics.oldestAge.Set(st.OldestDueAge.Seconds())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
