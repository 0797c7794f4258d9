package worker

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/admin"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/registry"
	"github.com/conveyorhq/conveyor/internal/service"
	"github.com/conveyorhq/conveyor/internal/telemetry"
	runner "github.com/conveyorhq/conveyor/internal/worker"
)

// run wires a worker and runs it until ctx is done.
func run(ctx context.Context, cfg config.Worker, stdout io.Writer, handlers []conveyor.Handler) error {
	// Before the database: one that is down is waited for, one that is up
	// is migrated, and neither is worth it for handlers that cannot run.
	if err := runner.CheckHandlers(handlers); err != nil {
		return err
	}
	hostname, _ := os.Hostname()
	if cfg.ID == "" {
		cfg.ID = fmt.Sprintf("%s-%d-%s", hostname, os.Getpid(), uuid.NewString()[:6])
	}
	rt, err := service.Start(ctx, cfg.Common, stdout, service.Options{
		Name: "conveyor-worker", LogAttrs: []any{"worker_id", cfg.ID},
		// Writes are short, but every running task makes them.
		MaxConns: int32(min(cfg.Concurrency/2+4, 64)),
		Plans:    postgres.PlansGeneric,
		WarmUp:   postgres.WorkerHotStatements,
		// Maintenance and scheduling search the tasks by status, and are
		// planned for the tables as they are at each pass.
		BackgroundPool: true,
		// A worker may start before any api: it brings the schema up too
		// (the runner is safe to run from many processes).
		Migrate: true,
	})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	log := rt.Log

	metrics := runner.NewMetrics(rt.Registry)
	// New outbox rows wake the relays; progress and every other change
	// wake the API's live streams and the scheduler. Every NOTIFY wakes
	// every listening backend of the database, so a busy worker sends one
	// per interval, not one per batch.
	notifier := postgres.NewNotifier(rt.Pool, cfg.NotifyInterval, log, postgres.OutboxChannel, postgres.EventsChannel)
	outboxPoke, eventsPoke := notifier.Poker(postgres.OutboxChannel), notifier.Poker(postgres.EventsChannel)
	store := postgres.NewWorkerStore(rt.Pool, outboxPoke)
	name := "conveyor-worker " + cfg.ID
	// A packed message holds up to TasksPerMessage tasks: the packed
	// queues get as many messages as fill the window (the worker follows
	// its read-ahead's pace with it).
	base, most := readAhead(cfg)
	packedPrefetch := runner.PackedPrefetch(cfg.Concurrency+base, cfg.TasksPerMessage)
	w, err := runner.New(runner.Config{
		Info: registry.Worker{
			ID: cfg.ID, Hostname: hostname, PID: os.Getpid(), Concurrency: cfg.Concurrency,
			Version: telemetry.Version,
		},
		Concurrency:         cfg.Concurrency,
		Lease:               cfg.LeaseDuration,
		Heartbeat:           cfg.HeartbeatInterval,
		ProgressInterval:    cfg.ProgressInterval,
		BackoffBase:         cfg.RetryBackoffBase,
		BackoffMax:          cfg.RetryBackoffMax,
		ShutdownTimeout:     cfg.ShutdownTimeout,
		MaxRunTime:          cfg.MaxRunTime,
		ReadAhead:           base,
		ReadAheadMax:        most,
		TasksPerMessage:     cfg.TasksPerMessage,
		CreditPerConsumer:   cfg.AMQPQueueType == rabbitmq.Quorum,
		WriteFlights:        cfg.WriteFlights,
		LongAfter:           time.Second,
		ReconnectBackoffMax: cfg.ReconnectBackoffMax,
	}, runner.Deps{
		Store: store,
		Broker: runner.BrokerFunc(func(_ context.Context, types []string, prefetch int) (runner.Source, error) {
			c, err := rabbitmq.DialConsumer(cfg.AMQPURL, name, cfg.Queues(), types, prefetch, packedPrefetch)
			if err != nil {
				return nil, err
			}
			return c, nil
		}),
		Log:            log,
		TracerProvider: rt.TracerProvider,
		Propagator:     rt.Propagator,
		Metrics:        metrics,
	}, handlers)
	if err != nil {
		return err
	}
	inspector := rabbitmq.NewInspector(cfg.AMQPURL, name+" maintenance")
	defer func() { _ = inspector.Close() }()
	maintenance := postgres.NewMaintenanceStore(rt.BackgroundPool, outboxPoke)
	maintenance.OnEvents = eventsPoke
	maintainer := runner.NewMaintainer(runner.MaintenanceConfig{
		WorkerID: cfg.ID, Interval: cfg.MaintenanceInterval, LeaderTTL: cfg.LeaderTTL,
		RepublishAfter: cfg.RepublishAfter, Retention: cfg.Retention, DeadAfter: cfg.WorkerDeadAfter,
		BackoffBase: cfg.RetryBackoffBase, BackoffMax: cfg.RetryBackoffMax, Lease: cfg.LeaseDuration,
	}, maintenance, runner.QueuesFunc(inspector.QueueReady), log, metrics)
	schedulerStore := postgres.NewSchedulerStore(rt.BackgroundPool, outboxPoke)
	schedulerStore.OnEvents = eventsPoke
	scheduler := runner.NewScheduler(runner.SchedulerConfig{
		Interval: cfg.SchedulerInterval, MinInterval: cfg.SchedulerMinInterval, CronEvery: 200 * time.Millisecond,
		Cron: job.CronConfig{CatchUp: cfg.CronCatchUp, MaxJobs: 100, MaxTicks: 1000},
		// Under load, passes come every minimum interval; a type in fair
		// mode with nothing waiting has its queue counted no more often
		// than an idle system's passes come.
		Admit: job.AdmitConfig{Window: cfg.AdmissionWindow, MinWindow: cfg.AdmissionMinWindow,
			DeadAfter: cfg.WorkerDeadAfter, MaxGroups: 1000, MaxAdmit: 1000, RecountAfter: cfg.SchedulerInterval},
	}, schedulerStore, maintainer.Leading, log, metrics, rt.TracerProvider)
	// Every task written or finished anywhere may be one to admit, or
	// free a slot: the scheduler wakes on the events' notifications, and
	// on this worker's own changes at once.
	wakeOnEvents := func() {
		eventsPoke()
		scheduler.Wake()
	}
	store.OnEvents = wakeOnEvents
	listener := postgres.NewListener(cfg.DatabaseURL, postgres.EventsChannel, scheduler.Wake, log)

	adm, err := admin.Listen(ctx, cfg.AdminAddr, rt.Registry, func(context.Context) (bool, map[string]any) {
		return w.Ready(), map[string]any{}
	}, log)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "worker started", "admin_addr", adm.Addr(), "types", w.Types(), "concurrency", cfg.Concurrency)

	// The notifier and admin server outlive ctx a little: the shutdown
	// hands tasks back (outbox rows to announce) and stays observable.
	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return adm.Run(bg) })
	g.Go(func() error { return notifier.Run(bg) })
	g.Go(func() error { return maintainer.Run(gctx) })
	g.Go(func() error { return scheduler.Run(gctx) })
	g.Go(func() error { return listener.Run(gctx) })
	g.Go(func() error {
		err := w.Run(gctx)
		stopBG()
		return err
	})
	err = g.Wait()
	log.InfoContext(ctx, "worker stopped")
	return err
}

// readAhead resolves WORKER_READ_AHEAD: the read-ahead, and the most it
// may grow to with the pace of the slots (0: it stays). A value set is
// kept as it is. The default follows the pace, from as many as the
// concurrency (at most 256) up to four times that: quick handlers then
// claim enough ahead to fill the database's batches (twice as large at
// the defaults in a burn-down of no-op tasks, which ran 0.95–1.15 times as
// fast in sets of alternated pairs), slow ones wait no longer for a slot
// than with the least. None on quorum queues: the worker
// withdraws its read-ahead while handlers run long by lowering the
// prefetch, but a quorum queue's consumer keeps the prefetch it started
// with: the deliveries read ahead would be requeued, redelivered at once
// and requeued again for as long as the handlers run (thousands of times
// in a test of 4-second tasks), each time counting towards the queue's
// delivery limit.
func readAhead(cfg config.Worker) (base, most int) {
	if cfg.ReadAhead >= 0 {
		return cfg.ReadAhead, 0
	}
	if cfg.AMQPQueueType == rabbitmq.Quorum {
		return 0, 0
	}
	base = min(cfg.Concurrency, 256)
	return base, 4 * base
}
