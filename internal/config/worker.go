package config

import (
	"fmt"
	"time"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Worker configures a worker binary (cmd/worker, or one built with
// worker.Main).
type Worker struct {
	Common
	// AMQPURL is one AMQP URL, or those of a cluster's nodes separated by
	// commas: each connection tries them in turn, each time starting from
	// the next one.
	AMQPURL string `envconfig:"AMQP_URL" default:"amqp://guest:guest@localhost:5672/"`
	// AMQPQueueType is the type of the task queues the worker declares:
	// classic (priorities honoured up to AMQP_MAX_PRIORITY) or quorum
	// (replicated over the cluster; see docs/quorum.md). Every worker of a
	// type must agree.
	AMQPQueueType rabbitmq.QueueType `envconfig:"AMQP_QUEUE_TYPE" default:"classic"`
	// AMQPMaxPriority is the highest task priority a classic queue keeps
	// apart (x-max-priority; a higher one counts as it): 9, all of them,
	// by default, 0 for queues without priorities, which deliver in
	// publication order and cost the broker less. Every worker of a type
	// must agree.
	AMQPMaxPriority int `envconfig:"AMQP_MAX_PRIORITY" default:"9"`
	// TasksPerMessage is the most tasks the relays pack into one message
	// (as they read it): the worker's prefetch of packed messages is its
	// window divided by it.
	TasksPerMessage int    `envconfig:"AMQP_TASKS_PER_MESSAGE" default:"64"`
	AdminAddr       string `envconfig:"WORKER_ADMIN_ADDR" default:":8082"`
	Concurrency     int    `envconfig:"WORKER_CONCURRENCY" default:"256"`
	// ID names the worker in the registry and on the tasks it runs; empty
	// means hostname, pid and a random suffix.
	ID string `envconfig:"WORKER_ID"`
	// LeaseDuration is how long a running task stays the worker's without a
	// renewal; HeartbeatInterval is how often it is renewed (and the
	// worker's registry row refreshed).
	LeaseDuration     time.Duration `envconfig:"LEASE_DURATION" default:"30s"`
	HeartbeatInterval time.Duration `envconfig:"HEARTBEAT_INTERVAL" default:"5s"`
	// ProgressInterval is the least time between two stored progress
	// reports of one task; the latest report always lands.
	ProgressInterval time.Duration `envconfig:"PROGRESS_MIN_INTERVAL" default:"250ms"`
	// RetryBackoffBase and RetryBackoffMax space a failed task's attempts:
	// base doubled per attempt, capped, with jitter.
	RetryBackoffBase time.Duration `envconfig:"RETRY_BACKOFF_BASE" default:"1s"`
	RetryBackoffMax  time.Duration `envconfig:"RETRY_BACKOFF_MAX" default:"5m"`
	// MaintenanceInterval is how often the elected worker runs maintenance;
	// LeaderTTL is how long its leadership lasts without renewal.
	MaintenanceInterval time.Duration `envconfig:"MAINTENANCE_INTERVAL" default:"5s"`
	LeaderTTL           time.Duration `envconfig:"LEADER_TTL" default:"15s"`
	// RepublishAfter is how long a PENDING task may wait, unclaimed and with
	// no message in the outbox, before maintenance publishes it again.
	RepublishAfter time.Duration `envconfig:"REPUBLISH_AFTER" default:"10m"`
	// Retention is how long terminal tasks (with their events, results and
	// keys), ended workflow runs and unread dataset versions are kept.
	Retention time.Duration `envconfig:"RETENTION" default:"168h"`
	// WorkerDeadAfter is how long a silent worker stays in the registry.
	WorkerDeadAfter time.Duration `envconfig:"WORKER_DEAD_AFTER" default:"1m"`
	// ReconnectBackoffMax caps the wait between reconnects to the broker.
	ReconnectBackoffMax time.Duration `envconfig:"WORKER_RECONNECT_BACKOFF_MAX" default:"5s"`
	// MaxRunTime bounds one attempt: past it the handler's context is
	// cancelled and the attempt fails as timed out.
	MaxRunTime time.Duration `envconfig:"TASK_MAX_RUN_TIME" default:"1h"`
	// NotifyInterval is the least time between two of the worker's wake-up
	// NOTIFY statements (the live streams, the scheduler, the relays). The
	// first write after a quiet spell wakes them at once; under load, the
	// writes of an interval share one statement.
	NotifyInterval time.Duration `envconfig:"WORKER_NOTIFY_INTERVAL" default:"20ms"`
	// ReadAhead is how many deliveries beyond its free slots a worker lets
	// the broker send it ahead, while no handler runs long: a freed slot
	// then finds its next task at once. -1 means a read-ahead that follows
	// the pace of the slots, from as many as WORKER_CONCURRENCY (at most
	// 256) up to four times that, or none with AMQP_QUEUE_TYPE=quorum (see
	// docs/quorum.md); 0 turns read-ahead off; any other value is kept as
	// it is.
	ReadAhead int `envconfig:"WORKER_READ_AHEAD" default:"-1"`
	// WriteFlights is how many of the worker's writes (its outcomes and
	// claims of the moment, one commit) may be in flight at once: a
	// further one starts only once enough calls wait for it.
	WriteFlights int `envconfig:"WORKER_WRITE_FLIGHTS" default:"2"`
	// SchedulerInterval is the longest time between two passes of the
	// scheduler (cron ticks, admission of waiting tasks) on the leader;
	// writes wake it sooner, but never more often than
	// SchedulerMinInterval.
	SchedulerInterval    time.Duration `envconfig:"SCHEDULER_INTERVAL" default:"500ms"`
	SchedulerMinInterval time.Duration `envconfig:"SCHEDULER_MIN_INTERVAL" default:"100ms"`
	// CronCatchUp: cron ticks missed by less than this (a leader's
	// failover, a restart) are all run; older ones follow the job's
	// missed policy.
	CronCatchUp time.Duration `envconfig:"CRON_CATCH_UP" default:"1m"`
	// AdmissionWindow is how many due, unclaimed tasks a type may have in
	// its queue before new ones wait and are admitted in turns between
	// orgs; 0 means the concurrency of its live workers, at least
	// AdmissionMinWindow.
	AdmissionWindow    int `envconfig:"ADMISSION_WINDOW" default:"0"`
	AdmissionMinWindow int `envconfig:"ADMISSION_MIN_WINDOW" default:"64"`
}

// Queues is how the worker declares its types' queues.
func (c Worker) Queues() rabbitmq.Queues {
	if c.AMQPQueueType == rabbitmq.Quorum {
		return rabbitmq.QuorumQueues
	}
	return rabbitmq.Queues{Type: c.AMQPQueueType, MaxPriority: c.AMQPMaxPriority}
}

// Validate checks the worker's configuration.
func (c Worker) Validate() error {
	if err := c.Common.Validate(); err != nil {
		return err
	}
	if err := validAMQPURL(c.AMQPURL); err != nil {
		return err
	}
	if _, err := rabbitmq.ParseQueueType(string(c.AMQPQueueType)); err != nil {
		return fmt.Errorf("AMQP_QUEUE_TYPE: %w", err)
	}
	if c.AMQPMaxPriority < 0 || c.AMQPMaxPriority > task.MaxPriority {
		return fmt.Errorf("AMQP_MAX_PRIORITY: must be between 0 (no priorities) and %d, got %d", task.MaxPriority, c.AMQPMaxPriority)
	}
	if c.AMQPQueueType == rabbitmq.Quorum && c.AMQPMaxPriority != task.MaxPriority {
		return fmt.Errorf("AMQP_MAX_PRIORITY: quorum queues take no priorities on RabbitMQ 3.x; leave it at its default with AMQP_QUEUE_TYPE=quorum")
	}
	if err := validTasksPerMessage(c.TasksPerMessage); err != nil {
		return err
	}
	if err := validAddr("WORKER_ADMIN_ADDR", c.AdminAddr); err != nil {
		return err
	}
	if c.Concurrency < 1 || c.Concurrency > 10000 {
		return fmt.Errorf("WORKER_CONCURRENCY: must be between 1 and 10000, got %d", c.Concurrency)
	}
	for name, d := range map[string]time.Duration{
		"LEASE_DURATION": c.LeaseDuration, "HEARTBEAT_INTERVAL": c.HeartbeatInterval,
		"PROGRESS_MIN_INTERVAL": c.ProgressInterval, "RETRY_BACKOFF_BASE": c.RetryBackoffBase,
		"RETRY_BACKOFF_MAX": c.RetryBackoffMax, "MAINTENANCE_INTERVAL": c.MaintenanceInterval,
		"LEADER_TTL": c.LeaderTTL, "REPUBLISH_AFTER": c.RepublishAfter, "RETENTION": c.Retention,
		"WORKER_DEAD_AFTER": c.WorkerDeadAfter, "WORKER_RECONNECT_BACKOFF_MAX": c.ReconnectBackoffMax,
		"TASK_MAX_RUN_TIME": c.MaxRunTime, "SCHEDULER_INTERVAL": c.SchedulerInterval,
		"SCHEDULER_MIN_INTERVAL": c.SchedulerMinInterval, "CRON_CATCH_UP": c.CronCatchUp,
		"WORKER_NOTIFY_INTERVAL": c.NotifyInterval,
	} {
		if err := positive(name, d); err != nil {
			return err
		}
	}
	if c.ReadAhead < -1 || c.ReadAhead > 10000 {
		return fmt.Errorf("WORKER_READ_AHEAD: must be -1 (following the pace of the slots), 0 (off) or up to 10000, got %d", c.ReadAhead)
	}
	if c.WriteFlights < 1 || c.WriteFlights > 16 {
		return fmt.Errorf("WORKER_WRITE_FLIGHTS: must be between 1 and 16, got %d", c.WriteFlights)
	}
	if c.AdmissionWindow < 0 || c.AdmissionWindow > 1000000 {
		return fmt.Errorf("ADMISSION_WINDOW: must be between 0 (automatic) and 1000000, got %d", c.AdmissionWindow)
	}
	if c.AdmissionMinWindow < 1 || c.AdmissionMinWindow > 1000000 {
		return fmt.Errorf("ADMISSION_MIN_WINDOW: must be between 1 and 1000000, got %d", c.AdmissionMinWindow)
	}
	// Halving the lease, not doubling the interval: a doubled interval of
	// a few million hours overflows and would pass.
	if c.HeartbeatInterval > c.LeaseDuration/2 {
		return fmt.Errorf("HEARTBEAT_INTERVAL: must be at most half of LEASE_DURATION (%s), got %s", c.LeaseDuration, c.HeartbeatInterval)
	}
	if c.MaintenanceInterval >= c.LeaderTTL {
		return fmt.Errorf("MAINTENANCE_INTERVAL: must be shorter than LEADER_TTL (%s), got %s", c.LeaderTTL, c.MaintenanceInterval)
	}
	// The scheduler waits SCHEDULER_MIN_INTERVAL after a pass, then for a
	// wake-up until SCHEDULER_INTERVAL after the pass: a minimum longer
	// than the longest would space every pass by it, unchecked against
	// CRON_CATCH_UP.
	if c.SchedulerMinInterval > c.SchedulerInterval {
		return fmt.Errorf("SCHEDULER_MIN_INTERVAL: must be at most SCHEDULER_INTERVAL (%s), got %s", c.SchedulerInterval, c.SchedulerMinInterval)
	}
	if gap := saturatingSum(c.LeaderTTL, c.MaintenanceInterval, c.SchedulerInterval, c.SchedulerMinInterval); c.CronCatchUp <= gap {
		// A leader's failover delays ticks by up to that much: its lease
		// runs out, the next worker to try an election (they try once a
		// maintenance interval) takes over, and its scheduler's next pass
		// (up to SCHEDULER_INTERVAL after its last; SCHEDULER_MIN_INTERVAL
		// counts too, as a margin for a slow pass) makes the ticks. With
		// less catch-up, a job that skips missed ticks would lose ordinary
		// ones.
		return fmt.Errorf("CRON_CATCH_UP: must be longer than LEADER_TTL + MAINTENANCE_INTERVAL + SCHEDULER_INTERVAL + SCHEDULER_MIN_INTERVAL (%s), got %s",
			gap, c.CronCatchUp)
	}
	if c.WorkerDeadAfter <= c.HeartbeatInterval {
		return fmt.Errorf("WORKER_DEAD_AFTER: must be longer than HEARTBEAT_INTERVAL (%s), got %s", c.HeartbeatInterval, c.WorkerDeadAfter)
	}
	return nil
}
