package relay

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the relay's Prometheus instruments.
type Metrics struct {
	published   *prometheus.CounterVec
	messages    prometheus.Counter
	failures    prometheus.Counter
	batchSize   prometheus.Histogram
	latency     prometheus.Histogram
	depth       prometheus.Gauge
	oldestAge   prometheus.Gauge
	blocked     prometheus.Gauge
	connected   prometheus.Gauge
	parked      prometheus.Counter
	parkedDepth prometheus.Gauge
	// statsFailures counts the samples of the outbox gauges that failed.
	statsFailures prometheus.Counter
}

// NewMetrics registers the relay's metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_relay_published_total", Help: "Outbox messages published and confirmed, by kind.",
		}, []string{"kind"}),
		messages: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "conveyor_relay_broker_messages_total",
			Help: "Broker messages confirmed that carried published outbox messages: fewer than those when tasks are packed.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "conveyor_relay_publish_failures_total", Help: "Messages nacked, returned or unconfirmed; their rows are retried.",
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "conveyor_relay_batch_size", Help: "Rows locked per relay transaction.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "conveyor_relay_commit_to_publish_seconds", Help: "From when the outbox row was due (its commit, or its scheduled time, retry or release) to the broker's confirm.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}),
		depth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_outbox_depth", Help: "Outbox rows due for publication.",
		}),
		oldestAge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_outbox_oldest_due_age_seconds", Help: "How long the oldest due outbox row has waited (outbox lag).",
		}),
		blocked: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_relay_broker_blocked", Help: "1 while the broker blocks publishers (memory or disk alarm).",
		}),
		connected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_relay_broker_connected", Help: "Broker connections the relay holds: one per lane while all are up.",
		}),
		parked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "conveyor_relay_parked_total", Help: "Messages no queue took (no worker for their type yet), parked in the outbox.",
		}),
		parkedDepth: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_outbox_parked", Help: "Outbox rows parked until a worker for their type declares its queue.",
		}),
		statsFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "conveyor_relay_outbox_stats_failures_total",
			Help: "Failed samples of the outbox gauges (depth, oldest due age, parked), which keep their last values meanwhile.",
		}),
	}
	reg.MustRegister(m.published, m.messages, m.failures, m.batchSize, m.latency, m.depth, m.oldestAge, m.blocked, m.connected,
		m.parked, m.parkedDepth, m.statsFailures)
	return m
}
