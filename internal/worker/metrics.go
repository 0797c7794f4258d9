package worker

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the worker's Prometheus instruments.
type Metrics struct {
	started       *prometheus.CounterVec
	finished      *prometheus.CounterVec
	duration      *prometheus.HistogramVec
	queueWait     *prometheus.HistogramVec
	cancelLatency prometheus.Histogram
	running       prometheus.Gauge
	dropped       *prometheus.CounterVec
	leader        prometheus.Gauge
	liveWorkers   prometheus.Gauge
	maintenance   *prometheus.CounterVec
	batchSize     *prometheus.HistogramVec
}

// NewMetrics registers the worker's metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		started: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_tasks_started_total", Help: "Task attempts started (claimed), by type.",
		}, []string{"type"}),
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_tasks_finished_total",
			Help: "Task attempts ended, by type and outcome (completed, failed, retried, cancelled, handed_back, lost, abandoned).",
		}, []string{"type", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "conveyor_task_duration_seconds", Help: "Duration of task attempts, by type and outcome.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2.5, 16),
		}, []string{"type", "outcome"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "conveyor_task_queue_wait_seconds", Help: "From when a task was due to when a worker claimed it.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 16),
		}, []string{"type"}),
		cancelLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "conveyor_task_cancel_latency_seconds", Help: "From the worker learning of a cancel to the task stored CANCELLED.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 14),
		}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_worker_running_tasks", Help: "Handlers running on this worker.",
		}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_worker_deliveries_dropped_total", Help: "Deliveries acked without running: duplicates, terminal or running tasks.",
		}, []string{"reason"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_worker_maintenance_leader", Help: "1 while this worker is the elected maintenance leader.",
		}),
		liveWorkers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "conveyor_workers_live", Help: "Workers in the registry, as last counted by the maintenance leader (0 on the other workers).",
		}),
		maintenance: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_maintenance_actions_total", Help: "Rows changed by maintenance, by action.",
		}, []string{"action"}),
		batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "conveyor_worker_batch_size", Help: "Claims or changes written by one statement of the worker, by statement (claim, apply).",
			Buckets: prometheus.ExponentialBuckets(1, 2, 11),
		}, []string{"statement"}),
	}
	reg.MustRegister(m.started, m.finished, m.duration, m.queueWait, m.cancelLatency, m.running, m.dropped,
		m.leader, m.liveWorkers, m.maintenance, m.batchSize)
	return m
}
