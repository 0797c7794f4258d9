package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/conveyorhq/conveyor/internal/postgres"
)

// fairness measures what one org's backlog costs another that shares its
// task type: the wait (started_at − created_at, both the database's clock)
// of org B's trickle of single submits, first alone, then while org A's
// backlog of -fair-backlog tasks drains, as a ratio. For reference the same
// backlog runs once more on a fresh system whose workers set
// ADMISSION_WINDOW to its maximum, so that the type never enters fair mode:
// B's tasks then queue behind A's, as they would without fairness.
func (b *bench) fairness(ctx context.Context) error {
	rate, d, n, ref := b.o.fairRate, time.Duration(b.o.fairSeconds)*time.Second, b.o.fairBacklog, b.o.fairRef
	var alone, fair, plain fairPhase
	err := b.scope(func() error {
		f, err := b.e.fairSystem(ctx, "bench_fair", b.o)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "  B alone: %d/s for %s\n", rate, d)
		if alone, err = f.phase(ctx, 0, rate, d, false); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "  B beside A's backlog of %d\n", n)
		fair, err = f.phase(ctx, n, rate, d, true)
		return err
	})
	if err != nil {
		return err
	}
	err = b.scope(func() error {
		f, err := b.e.fairSystem(ctx, "bench_fair_off", b.o, "ADMISSION_WINDOW=1000000")
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "  B beside A's backlog of %d, fair mode out of reach (ADMISSION_WINDOW=1000000)\n", ref)
		plain, err = f.phase(ctx, ref, rate, d, false)
		return err
	})
	if err != nil {
		return err
	}

	conf := fmt.Sprintf("%d/s for %s", rate, d)
	aloneP50 := fmt.Sprintf("Conveyor fairness: B alone, wait p50 (%s)", conf)
	aloneP99 := fmt.Sprintf("Conveyor fairness: B alone, wait p99 (%s)", conf)
	b.add(result{Name: aloneP50, Value: ms(alone.p50), Unit: "ms"})
	b.add(result{Name: aloneP99, Value: ms(alone.p99), Unit: "ms"})
	beside := fmt.Sprintf("Conveyor fairness: B beside A's %d backlog, wait", n)
	b.vs(beside+" p50", ms(fair.p50), "ms", aloneP50, 0)
	b.vs(beside+" p99", ms(fair.p99), "ms", aloneP99, 0)
	// Where B's wait goes: to its admission (the scheduler's passes), then
	// to the relay and the queue ahead of it in the broker (the window).
	b.add(result{Name: "  B beside A: submit→admitted p50 (polled every 5 ms)", Value: ms(fair.admitP50), Unit: "ms"})
	b.add(result{Name: "  B beside A: submit→admitted p99", Value: ms(fair.admitP99), Unit: "ms"})
	b.add(result{Name: "  B beside A: admitted→started p50", Value: ms(fair.runP50), Unit: "ms"})
	b.add(result{Name: "  B beside A: admitted→started p99", Value: ms(fair.runP99), Unit: "ms"})
	b.add(result{Name: "  type's admitted, unclaimed tasks while B ran, mean", Value: fair.readyMean, Unit: "tasks"})
	b.add(result{Name: "  type's admitted, unclaimed tasks while B ran, max", Value: float64(fair.readyMax), Unit: "tasks"})
	b.add(result{Name: "  type in fair mode while B ran", Value: fair.fairShare * 100, Unit: "%"})
	aRate := "Conveyor fairness: A's throughput while B ran, fair"
	b.add(result{Name: aRate, Value: fair.aPerSec, Unit: "tasks/s"})
	b.add(result{Name: "Conveyor fairness: A's batch submit, fair", Value: fair.submitPerSec, Unit: "tasks/s"})
	left := result{Name: "Conveyor fairness: A's backlog when B's last task started", Value: float64(fair.aLeft), Unit: "tasks",
		Target: "> 0 (B measured beside a backlog)"}
	met := fair.aLeft > 0
	left.Met = &met
	b.add(left)
	// The reference's backlog may be smaller than the fair run's: B waits
	// for all of it, which takes minutes on a slow day.
	b.vs(fmt.Sprintf("Conveyor fairness: B beside A's %d backlog, fair mode off, wait p50", ref), ms(plain.p50), "ms", aloneP50, 0)
	b.vs(fmt.Sprintf("Conveyor fairness: B beside A's %d backlog, fair mode off, wait p99", ref), ms(plain.p99), "ms", aloneP99, 0)
	b.vs("Conveyor fairness: A's throughput while B ran, fair mode off", plain.aPerSec, "tasks/s", aRate, 0)
	b.add(result{Name: "Conveyor fairness: A's backlog when B's last task started, fair mode off", Value: float64(plain.aLeft), Unit: "tasks"})
	b.vs("Conveyor fairness: A's batch submit, fair mode off", plain.submitPerSec, "tasks/s", "Conveyor fairness: A's batch submit, fair", 0)
	// Without fairness B's first task waits behind all of A's queue: the
	// worst wait, and about the p99. The throughput is the reference's,
	// without the scheduler in the way.
	b.vs(fmt.Sprintf("Conveyor fairness: B's p99 beside A's %d backlog without fairness, estimated", n),
		fair.aAhead/max(plain.aPerSec, 1)*1000, "ms", aloneP99, 0)
	if !met {
		fmt.Fprintln(os.Stderr, "  warning: A's backlog drained before B's trickle ended; raise -fair-backlog or lower -fair-seconds")
	}
	return nil
}

// fairSystem is a running Conveyor with two orgs, A and B, and workers of
// the burn-down's configuration.
type fairSystem struct {
	*system
	tokenA, tokenB string
	orgA           string
}

// fairSystem starts an api, a relay and -fair-procs workers sharing -workers
// slots; workerVars are added to each worker's environment.
func (e *env) fairSystem(ctx context.Context, name string, o options, workerVars ...string) (*fairSystem, error) {
	s, err := e.system(ctx, name, o.pool)
	if err != nil {
		return nil, err
	}
	if err := s.startRelay(); err != nil {
		return nil, err
	}
	for i := range o.fairProcs {
		if err := s.startWorker(fmt.Sprintf("worker-%d", i), max(o.workers/o.fairProcs, 1), workerVars...); err != nil {
			return nil, err
		}
	}
	f := &fairSystem{system: s}
	dir := postgres.NewDirectory(s.pool)
	if f.tokenA, err = dir.Bootstrap(ctx, "org-a", "bench"); err != nil {
		return nil, err
	}
	if f.tokenB, err = dir.Bootstrap(ctx, "org-b", "bench"); err != nil {
		return nil, err
	}
	if err := s.pool.QueryRow(ctx, `SELECT id::text FROM orgs WHERE slug = 'org-a'`).Scan(&f.orgA); err != nil {
		return nil, err
	}
	return f, nil
}

// fairPhase is what one phase measured.
type fairPhase struct {
	p50, p99           time.Duration // B's waits
	admitP50, admitP99 time.Duration // B's submit→admitted (watched phases)
	runP50, runP99     time.Duration // B's admitted→started (watched phases)
	submitPerSec       float64       // A's batch submits
	aPerSec            float64       // A's tasks started per second while B ran
	aAhead, aLeft      float64       // A's tasks not yet started at B's first submit, at B's last start
	readyMean          float64       // admitted, unclaimed tasks while B ran (watched phases)
	readyMax           int
	fairShare          float64 // share of samples with the type in fair mode (watched phases)
}

// phase submits backlog tasks as org A (none: B alone), then B's trickle
// once A's backlog is in, and measures B's waits. watch polls B's tasks for
// the moment of their admission and samples the type's queue and mode.
func (f *fairSystem) phase(ctx context.Context, backlog, rate int, d time.Duration, watch bool) (fairPhase, error) {
	var ph fairPhase
	if backlog > 0 {
		start := time.Now()
		if err := f.backlogA(backlog, 4); err != nil {
			return ph, err
		}
		ph.submitPerSec = float64(backlog) / time.Since(start).Seconds()
		fmt.Fprintf(os.Stderr, "    A: %d tasks submitted in %s\n", backlog, time.Since(start).Round(100*time.Millisecond))
	}
	tr := &trickle{f: f, admitted: map[string]time.Time{}}
	stop := func() {}
	if watch {
		stop = tr.watch(ctx)
	}
	err := tr.run(rate, d)
	if err == nil {
		err = waitFor(5*time.Minute, 20*time.Millisecond, func() (bool, error) {
			var n int
			err := f.pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE id = ANY ($1::uuid[]) AND started_at IS NOT NULL`, tr.ids).Scan(&n)
			return n == len(tr.ids), err
		})
	}
	stop()
	if err != nil {
		return ph, err
	}

	rows, err := f.pool.Query(ctx, `SELECT id::text, created_at, started_at FROM tasks WHERE id = ANY ($1::uuid[])`, tr.ids)
	if err != nil {
		return ph, err
	}
	var waits, admit, run []time.Duration
	var first, last time.Time
	for rows.Next() {
		var id string
		var created, started time.Time
		if err := rows.Scan(&id, &created, &started); err != nil {
			return ph, err
		}
		waits = append(waits, started.Sub(created))
		if at, ok := tr.admitted[id]; ok {
			admit = append(admit, max(at.Sub(created), 0))
			run = append(run, max(started.Sub(at), 0))
		}
		if first.IsZero() || created.Before(first) {
			first = created
		}
		if started.After(last) {
			last = started
		}
	}
	if err := rows.Err(); err != nil {
		return ph, err
	}
	ph.p50, ph.p99 = percentile(waits, 0.5), percentile(waits, 0.99)
	ph.admitP50, ph.admitP99 = percentile(admit, 0.5), percentile(admit, 0.99)
	ph.runP50, ph.runP99 = percentile(run, 0.5), percentile(run, 0.99)
	if len(tr.ready) > 0 {
		sum, fair := 0, 0
		for i, r := range tr.ready {
			sum += r
			ph.readyMax = max(ph.readyMax, r)
			if tr.fair[i] {
				fair++
			}
		}
		ph.readyMean = float64(sum) / float64(len(tr.ready))
		ph.fairShare = float64(fair) / float64(len(tr.ready))
	}
	if backlog > 0 {
		// All of A's tasks were written before B's first: from the
		// database's own clock, how many of them were still to start when
		// B began and when B's last task started, and how many started in
		// between.
		var during int
		err := f.pool.QueryRow(ctx, `SELECT
				count(*) FILTER (WHERE started_at IS NULL OR started_at > $2),
				count(*) FILTER (WHERE started_at IS NULL OR started_at > $3),
				count(*) FILTER (WHERE started_at > $2 AND started_at <= $3)
			FROM tasks WHERE org_id = $1::uuid`, f.orgA, first, last).Scan(&ph.aAhead, &ph.aLeft, &during)
		if err != nil {
			return ph, err
		}
		ph.aPerSec = float64(during) / last.Sub(first).Seconds()
	}
	fmt.Fprintf(os.Stderr, "    B: %d tasks, wait p50 %.1f ms, p99 %.1f ms, max %.1f ms", len(waits), ms(ph.p50), ms(ph.p99), ms(percentile(waits, 1)))
	if backlog > 0 {
		fmt.Fprintf(os.Stderr, "; A: %.0f ahead of B, %.0f left at B's end, %.0f tasks/s", ph.aAhead, ph.aLeft, ph.aPerSec)
	}
	fmt.Fprintln(os.Stderr)
	return ph, nil
}

// backlogA submits n tasks as org A in batches of 1000 from conc clients.
func (f *fairSystem) backlogA(n, conc int) error {
	run := submitRuns.Add(1)
	next := make(chan int)
	go func() {
		defer close(next)
		for done := 0; done < n; done += 1000 {
			next <- done
		}
	}()
	errs := make(chan error, conc)
	var wg sync.WaitGroup
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for done := range next {
				code, err := f.postAs(f.tokenA, "/v1/tasks/batch", batchBody(min(1000, n-done), fmt.Sprintf("a-%d-%d", run, done)), nil)
				if err == nil && code != http.StatusOK {
					err = fmt.Errorf("batch as org A: status %d", code)
				}
				if err != nil {
					errs <- err
					for range next { // let the feeder finish
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// trickle is org B's stream of single submits.
type trickle struct {
	f        *fairSystem
	mu       sync.Mutex
	ids      []string
	admitted map[string]time.Time // B's task → when it was first seen admitted (database clock)
	ready    []int                // samples of the type's admitted, unclaimed tasks
	fair     []bool               // and of its mode
}

// run submits one task as org B every 1/rate for d, each on its own
// goroutine: the trickle does not slow down when the system does.
func (t *trickle) run(rate int, d time.Duration) error {
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	errs := make(chan error, 1)
	for i := 0; time.Now().Before(end); i++ {
		<-tick.C
		wg.Add(1)
		go func() {
			defer wg.Done()
			var created struct {
				ID string `json:"id"`
			}
			code, err := t.f.postAs(t.f.tokenB, "/v1/tasks", fmt.Appendf(nil, `{"type": "demo.noop", "dedupe": false, "payload": {"trickle": %d}}`, i), &created)
			if err == nil && code != http.StatusCreated {
				err = fmt.Errorf("submit as org B: status %d", code)
			}
			if err != nil {
				select {
				case errs <- err:
				default:
				}
				return
			}
			t.mu.Lock()
			t.ids = append(t.ids, created.ID)
			t.mu.Unlock()
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}

// watch polls, every 5 ms, which of B's tasks have been admitted, and
// every 200 ms the type's admitted, unclaimed tasks and its mode, until the
// returned function is called.
func (t *trickle) watch(ctx context.Context) func() {
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		sample := time.Now()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			t.mu.Lock()
			var open []string
			for _, id := range t.ids {
				if _, ok := t.admitted[id]; !ok {
					open = append(open, id)
				}
			}
			t.mu.Unlock()
			if len(open) > 0 {
				rows, err := t.f.pool.Query(ctx, `SELECT id::text, clock_timestamp() FROM tasks WHERE id = ANY ($1::uuid[]) AND admitted`, open)
				if err == nil {
					var id string
					var at time.Time
					t.mu.Lock()
					for rows.Next() {
						if rows.Scan(&id, &at) == nil {
							t.admitted[id] = at
						}
					}
					t.mu.Unlock()
					rows.Close()
				}
			}
			if time.Since(sample) >= 200*time.Millisecond {
				sample = time.Now()
				var ready int
				var fair bool
				err := t.f.pool.QueryRow(ctx, `SELECT
						(SELECT count(*) FROM tasks WHERE type = 'demo.noop' AND admitted AND status = 'PENDING'),
						coalesce((SELECT NOT admit_directly FROM task_types WHERE name = 'demo.noop'), false)`).Scan(&ready, &fair)
				if err == nil {
					t.mu.Lock()
					t.ready, t.fair = append(t.ready, ready), append(t.fair, fair)
					t.mu.Unlock()
				}
			}
		}
	}()
	return func() { close(done); <-stopped }
}
