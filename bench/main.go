// Command bench measures Conveyor against the ceilings of the machine it
// runs on (bare pgx, bare amqp091-go) and against River, all in one run, and
// reports every figure as a ratio to its baseline. It is its own module so
// that the product does not depend on what it is compared with.
//
//	cd bench && go run . [-quick] [-out results/latest.json]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/postgres"
)

type options struct {
	conc        int
	pool        int
	dur         time.Duration
	burnN       int
	scaleN      int
	stmtBatch   int
	workers     int
	messages    int
	rate        int
	backlogs    []int
	sampleFor   time.Duration
	out         string
	adminURL    string
	amqpURL     string
	skipBacklog bool
	only        string
	streams     int
	streamRate  int
	fairBacklog int
	fairRate    int
	fairSeconds int
	fairProcs   int
	fairRef     int
	// riverWorkers and conveyorWorkers are the burn-down's sweeps: River's
	// MaxWorkers and Conveyor's WORKER_CONCURRENCY; the best of each is
	// its figure.
	riverWorkers    []int
	conveyorWorkers []int
	// burnTries is how many times each burn-down configuration runs (each
	// on a fresh database); its best is its figure.
	burnTries int
	// mixedN is the mixed workload's backlog.
	mixedN int
}

// result is one line of the report.
type result struct {
	Name     string  `json:"name"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Baseline string  `json:"baseline,omitempty"`
	Ratio    float64 `json:"ratio,omitempty"`
	Target   string  `json:"target,omitempty"`
	Met      *bool   `json:"met,omitempty"`
	// Config is the configuration a best-of-a-sweep figure came from.
	Config string `json:"config,omitempty"`
}

type report struct {
	Started  time.Time         `json:"started"`
	Machine  map[string]string `json:"machine"`
	Options  map[string]any    `json:"options"`
	Results  []result          `json:"results"`
	Duration string            `json:"duration"`
}

func main() {
	var o options
	quick := flag.Bool("quick", false, "small sizes and short runs (a smoke test of the benchmark itself); flags given explicitly are kept")
	flag.IntVar(&o.conc, "concurrency", 32, "concurrent clients for the submit measurements")
	flag.IntVar(&o.pool, "pool", 16, "database connections of the API and of the direct-pgx ceiling")
	flag.DurationVar(&o.dur, "duration", 10*time.Second, "length of each timed measurement")
	flag.IntVar(&o.burnN, "n", 20000, "tasks (and River jobs) in each burn-down, and tasks claimed and completed in the statements step")
	flag.IntVar(&o.scaleN, "scale-n", 100000, "tasks in each scale-out burn-down: long enough that the processes' start, which its clock includes, weighs little")
	flag.IntVar(&o.stmtBatch, "statements-batch", 100, "tasks per claim and per completion in the statements step (about what a busy worker's batches hold)")
	flag.IntVar(&o.burnTries, "burn-tries", 2, "runs of each burn-down configuration (River's and Conveyor's alike), each on a fresh database; the best is its figure")
	flag.IntVar(&o.workers, "workers", 64, "handler concurrency of the fairness measurement's workers (WORKER_CONCURRENCY, shared by -fair-procs)")
	riverWorkers := flag.String("river-workers", "100,500,2000", "River MaxWorkers values of the burn-down sweep, each on a fresh database; the best is River's figure")
	conveyorWorkers := flag.String("conveyor-workers", "64,256,1024,4096", "Conveyor WORKER_CONCURRENCY values of the tuned burn-down sweep (read-ahead at its default); the best is Conveyor's figure")
	flag.IntVar(&o.messages, "messages", 100000, "messages for the publish and relay measurements (the consume ceiling drains the burn-down's backlog, -n)")
	flag.IntVar(&o.mixedN, "mixed-n", 10000, "tasks in the mixed workload's burn-down (1 in 50 runs 5 s, the rest 50 ms)")
	flag.IntVar(&o.rate, "rate", 200, "offered rate (tasks/s) of the latency measurement")
	backlogs := flag.String("backlogs", "10000,1000000", "small and large backlogs of the memory measurement")
	flag.DurationVar(&o.sampleFor, "sample", 20*time.Second, "how long relay and worker RSS is sampled per backlog")
	flag.BoolVar(&o.skipBacklog, "skip-backlog", false, "skip the memory-versus-backlog measurement")
	flag.IntVar(&o.streams, "streams", 1000, "open live streams in the stream measurement")
	flag.IntVar(&o.streamRate, "stream-rate", 20, "progress writes per second in the stream measurement (each reaches every stream)")
	flag.IntVar(&o.fairBacklog, "fair-backlog", 100000, "org A's backlog in the fairness measurement")
	flag.IntVar(&o.fairRate, "fair-rate", 20, "org B's trickle (tasks/s) in the fairness measurement")
	flag.IntVar(&o.fairSeconds, "fair-seconds", 15, "how long org B's trickle lasts, in seconds")
	flag.IntVar(&o.fairRef, "fair-ref-backlog", 20000, "org A's backlog in the fairness measurement's reference run with fair mode off (B waits for all of it)")
	flag.IntVar(&o.fairProcs, "fair-procs", 1, "worker processes in the fairness measurement, sharing -workers slots")
	flag.StringVar(&o.only, "only", "", "comma-separated steps to run: "+strings.Join(stepKeys(), ",")+" (default all)")
	flag.StringVar(&o.out, "out", "results/latest.json", "where to write the JSON report")
	flag.StringVar(&o.adminURL, "database", envOr("BENCH_DATABASE_URL", "postgres://postgres@localhost:5432/postgres?sslmode=disable"), "PostgreSQL to create scratch databases in")
	flag.StringVar(&o.amqpURL, "amqp", envOr("BENCH_AMQP_URL", "amqp://guest:guest@localhost:5672/"), "RabbitMQ to create scratch vhosts in")
	flag.Parse()
	if *quick {
		given := map[string]bool{}
		flag.Visit(func(f *flag.Flag) { given[f.Name] = true })
		quickly := func(name string, set func()) {
			if !given[name] {
				set()
			}
		}
		quickly("duration", func() { o.dur = 2 * time.Second })
		quickly("n", func() { o.burnN = 2000 })
		quickly("scale-n", func() { o.scaleN = 2000 })
		quickly("burn-tries", func() { o.burnTries = 1 })
		quickly("messages", func() { o.messages = 10000 })
		quickly("mixed-n", func() { o.mixedN = 2000 })
		quickly("sample", func() { o.sampleFor = 3 * time.Second })
		quickly("backlogs", func() { *backlogs = "10000,100000" })
		// River's sweep at its two ends (a database each, cheap); one
		// tuned Conveyor configuration, as each costs a whole system.
		quickly("river-workers", func() { *riverWorkers = "100,2000" })
		quickly("conveyor-workers", func() { *conveyorWorkers = "64" })
		quickly("fair-backlog", func() { o.fairBacklog = 20000 })
		quickly("fair-ref-backlog", func() { o.fairRef = 5000 })
		quickly("fair-seconds", func() { o.fairSeconds = 4 })
	}
	if o.fairRate < 1 || o.fairSeconds < 1 || o.fairBacklog < 1 || o.fairRef < 1 || o.fairProcs < 1 {
		fmt.Fprintln(os.Stderr, "bench: -fair-backlog, -fair-ref-backlog, -fair-rate, -fair-seconds and -fair-procs must be positive")
		os.Exit(2)
	}
	if o.stmtBatch < 1 || o.mixedN < 1 {
		fmt.Fprintln(os.Stderr, "bench: -statements-batch and -mixed-n must be positive")
		os.Exit(2)
	}
	for _, l := range []struct {
		flag string
		text string
		dst  *[]int
	}{{"backlogs", *backlogs, &o.backlogs}, {"river-workers", *riverWorkers, &o.riverWorkers}, {"conveyor-workers", *conveyorWorkers, &o.conveyorWorkers}} {
		var err error
		if *l.dst, err = counts(l.text); err != nil {
			fmt.Fprintf(os.Stderr, "bench: -%s: %v\n", l.flag, err)
			os.Exit(2)
		}
	}
	for _, k := range strings.Split(o.only, ",") {
		if o.only != "" && !slices.Contains(stepKeys(), k) {
			fmt.Fprintf(os.Stderr, "bench: -only: no step %q (steps: %s)\n", k, strings.Join(stepKeys(), ","))
			os.Exit(2)
		}
	}
	if err := run(context.Background(), o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// counts parses a comma-separated list of positive counts.
func counts(list string) ([]int, error) {
	var out []int
	for _, s := range strings.Split(list, ",") {
		var n int
		if _, err := fmt.Sscan(s, &n); err != nil || n <= 0 {
			return nil, fmt.Errorf("%q is not a positive count", s)
		}
		out = append(out, n)
	}
	return out, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

type bench struct {
	o       options
	e       *env
	results []result
	// riverBest is River's best MaxWorkers in this run (0: the river step
	// did not run), for the burn-down's head-to-head.
	riverBest int
}

func (b *bench) add(r result) {
	b.results = append(b.results, r)
	fmt.Fprintf(os.Stderr, "  %-48s %12.1f %s\n", r.Name, r.Value, r.Unit)
}

// vs adds a result with its ratio to a baseline result and, when given, a
// target on that ratio (at least min when higher is better).
func (b *bench) vs(name string, value float64, unit, baseline string, minRatio float64) {
	r := result{Name: name, Value: value, Unit: unit, Baseline: baseline}
	for _, x := range b.results {
		if x.Name == baseline && x.Value > 0 {
			r.Ratio = value / x.Value
		}
	}
	if minRatio > 0 {
		r.atLeast(minRatio, "")
	}
	b.add(r)
}

// last is the result added last, for what is known only after it.
func (b *bench) last() *result { return &b.results[len(b.results)-1] }

// atLeast sets a target on r's ratio: at least minRatio, for the reason
// why when there is one to give.
func (r *result) atLeast(minRatio float64, why string) {
	met := r.Ratio >= minRatio
	r.Target, r.Met = fmt.Sprintf("ratio ≥ %.2f", minRatio), &met
	if why != "" {
		r.Target += " (" + why + ")"
	}
}

// atMost adds a result with an absolute target.
func (b *bench) atMost(name string, value float64, unit string, limit float64) {
	met := value <= limit
	b.add(result{Name: name, Value: value, Unit: unit, Target: fmt.Sprintf("≤ %g %s", limit, unit), Met: &met})
}

// steps are the measurements, in the order they run; -only picks some by key.
var steps = []struct {
	key, name string
	fn        func(*bench, context.Context) error
}{
	{"ceilings", "ceilings: direct pgx submit, bare publish and consume", (*bench).ceilings},
	{"river", "River: inserts and burn-down", (*bench).river},
	{"submits", "Conveyor: HTTP submits", (*bench).submits},
	{"relay", "Conveyor: relay throughput", (*bench).relay},
	{"statements", "Conveyor: the worker's claim and completion, PostgreSQL CPU per task", (*bench).statements},
	{"burndown", "Conveyor: burn-down, default and tuned", (*bench).burnDown},
	{"scaleout", "Conveyor: scale-out, worker and relay processes", (*bench).scaleOut},
	{"latency", "Conveyor: submit-to-start latency at a fixed rate", (*bench).latency},
	{"mixed", "Conveyor: a mixed workload, tasks packed and a task a message", (*bench).mixed},
	{"streams", "Conveyor: live streams, progress write to clients", (*bench).streams},
	{"fairness", "Conveyor: one org's trickle beside another's backlog", (*bench).fairness},
	{"backlog", "Conveyor: memory against backlog", (*bench).backlog},
}

func stepKeys() []string {
	keys := make([]string, len(steps))
	for i, s := range steps {
		keys[i] = s.key
	}
	return keys
}

func run(ctx context.Context, o options) error {
	started := time.Now()
	e := &env{adminURL: o.adminURL, amqpURL: o.amqpURL}
	defer e.close()
	fmt.Fprintln(os.Stderr, "building the binaries...")
	if err := e.build(); err != nil {
		return err
	}
	b := &bench{o: o, e: e}
	for _, s := range steps {
		if (s.key == "backlog" && o.skipBacklog) || (o.only != "" && !slices.Contains(strings.Split(o.only, ","), s.key)) {
			continue
		}
		fmt.Fprintln(os.Stderr, s.name)
		stepStart := time.Now()
		if err := s.fn(b, ctx); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		fmt.Fprintf(os.Stderr, "  (%s)\n", time.Since(stepStart).Round(time.Second))
	}
	rep := report{
		Started: started, Results: b.results, Duration: time.Since(started).Round(time.Second).String(),
		Machine: machine(ctx, e),
		Options: map[string]any{
			"concurrency": o.conc, "pool": o.pool, "duration": o.dur.String(), "n": o.burnN, "scale_n": o.scaleN, "workers": o.workers,
			"river_workers": o.riverWorkers, "conveyor_workers": o.conveyorWorkers, "burn_tries": o.burnTries,
			"messages": o.messages, "rate": o.rate, "backlogs": o.backlogs, "sample": o.sampleFor.String(),
			"streams": o.streams, "stream_rate": o.streamRate, "fair_backlog": o.fairBacklog, "fair_rate": o.fairRate,
			"fair_seconds": o.fairSeconds, "fair_procs": o.fairProcs, "fair_ref_backlog": o.fairRef,
			"mixed_n": o.mixedN,
		},
	}
	printTable(os.Stdout, rep)
	if err := os.MkdirAll(filepath.Dir(o.out), 0o755); err != nil {
		return err
	}
	data, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(o.out, append(data, '\n'), 0o644)
}

// scope runs fn and then releases what it created (processes, databases,
// vhosts), so each measurement starts on a clean machine.
func (b *bench) scope(fn func() error) error {
	mark := len(b.e.cleanups)
	defer func() {
		for i := len(b.e.cleanups) - 1; i >= mark; i-- {
			b.e.cleanups[i]()
		}
		b.e.cleanups = b.e.cleanups[:mark]
	}()
	return fn()
}

// ceilingDatabase creates a migrated scratch database for the direct-pgx
// submit ceiling and returns a pool of the API's size on it.
func (b *bench) ceilingDatabase(ctx context.Context, name string) (*pgxpool.Pool, error) {
	_, pool, err := b.e.database(ctx, name, int32(b.o.pool))
	if err != nil {
		return nil, err
	}
	if _, err := postgres.Migrate(ctx, pool, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		return nil, err
	}
	return pool, nil
}

func (b *bench) ceilings(ctx context.Context) error {
	err := b.scope(func() error {
		pool, err := b.ceilingDatabase(ctx, "bench_ceiling")
		if err != nil {
			return err
		}
		v, err := submitCeiling(ctx, pool, b.o.conc, b.o.dur, false)
		if err != nil {
			return err
		}
		b.add(result{Name: "ceiling: submit tx, direct pgx", Value: v, Unit: "tasks/s"})
		amqpURL, err := b.e.vhost("bench_ceiling")
		if err != nil {
			return err
		}
		cpu := meterCPU(ctx, pool)
		if v, err = publishCeiling(amqpURL, b.o.messages, 500); err != nil {
			return err
		}
		cpu(fmt.Sprintf("bare publisher, %.0f msgs/s", v), float64(b.o.messages))
		b.add(result{Name: "ceiling: publish, bare amqp091 (confirms, 500/batch)", Value: v, Unit: "msgs/s"})
		return nil
	})
	if err != nil {
		return err
	}
	// The consume ceiling at the prefetch of every tuned configuration,
	// since the best of them is not known yet.
	var prefetches []int
	for _, c := range b.o.conveyorWorkers {
		prefetches = append(prefetches, workerPrefetch(c))
	}
	return b.consumeCeilings(ctx, prefetches...)
}

// consumeCeilings measures the bare consumer at each prefetch it has not
// been measured at in this run, draining a backlog as large as the
// burn-down's, the best of -burn-tries drains: acking each message, as a
// worker acks each task, and acking half a window at a time with
// multiple=true, the best a consumer can do.
func (b *bench) consumeCeilings(ctx context.Context, prefetches ...int) error {
	return b.scope(func() error {
		var amqpURL string
		for _, p := range prefetches {
			for _, multiple := range []bool{false, true} {
				name := consumeCeilingName(p, multiple)
				if slices.ContainsFunc(b.results, func(r result) bool { return r.Name == name }) {
					continue
				}
				if amqpURL == "" {
					var err error
					if amqpURL, err = b.e.vhost("bench_consume"); err != nil {
						return err
					}
				}
				every := 1
				if multiple {
					every = multipleAckEvery(p)
				}
				// The burn-down's backlog, and its best of as many
				// tries: a deeper queue costs the broker more per message
				// (100,000 messages drained at a third of the rate of
				// 20,000 here), and the same drain lands in a fast or a
				// slow state from run to run, as the burn-downs do.
				best := 0.0
				for range b.o.burnTries {
					v, err := consumeCeiling(ctx, amqpURL, b.o.burnN, p, every)
					if err != nil {
						return err
					}
					best = max(best, v)
				}
				b.add(result{Name: name, Value: best, Unit: "msgs/s"})
			}
		}
		return nil
	})
}

func consumeCeilingName(prefetch int, multiple bool) string {
	if !multiple {
		return fmt.Sprintf("ceiling: consume, bare amqp091 (acks, prefetch %d)", prefetch)
	}
	return fmt.Sprintf("ceiling: consume, bare amqp091 (multiple acks every %d, prefetch %d)", multipleAckEvery(prefetch), prefetch)
}

func (b *bench) river(ctx context.Context) error {
	err := b.scope(func() error {
		_, pool, err := b.e.database(ctx, "bench_river_insert", int32(b.o.pool))
		if err != nil {
			return err
		}
		if err := riverMigrate(ctx, pool); err != nil {
			return err
		}
		v, err := riverInsert(ctx, pool, b.o.conc, b.o.dur)
		if err != nil {
			return err
		}
		b.vs("River: insert, one job per tx", v, "jobs/s", "ceiling: submit tx, direct pgx", 0)
		return nil
	})
	if err != nil {
		return err
	}
	// The burn-down at each MaxWorkers, each run on a fresh database with
	// the same n jobs, -burn-tries times in turns; River's figure is the
	// best of them.
	runs, err := sweep(b.o.burnTries, len(b.o.riverWorkers), func(r riverRun) float64 { return r.perSec },
		func(i, try int) (riverRun, error) {
			return b.riverBurn(ctx, fmt.Sprintf("bench_river_burn_%d_%d", b.o.riverWorkers[i], try), b.o.riverWorkers[i])
		})
	if err != nil {
		return err
	}
	var best riverRun
	var bestWorkers int
	for i, w := range b.o.riverWorkers {
		b.add(result{Name: fmt.Sprintf("River: burn-down, MaxWorkers %d", w), Value: runs[i].perSec, Unit: "jobs/s"})
		if runs[i].perSec > best.perSec {
			best, bestWorkers = runs[i], w
		}
	}
	b.riverBest = bestWorkers
	config := fmt.Sprintf("MaxWorkers %d", bestWorkers)
	b.add(result{Name: "River: burn-down of no-op jobs", Value: best.perSec, Unit: "jobs/s", Config: config})
	b.add(result{Name: "River: write transactions per job (burn-down)", Value: best.commits, Unit: "txs", Config: config})
	b.add(result{Name: "River: WAL per job (burn-down)", Value: best.wal, Unit: "bytes", Config: config})
	b.add(result{Name: fmt.Sprintf("River: connections opened (burn-down, pool of %d)", riverPoolConns), Value: float64(best.conns), Unit: "conns", Config: config})
	return nil
}

type riverRun struct {
	burnResult
	conns int32
}

// riverBurn runs one River burn-down on a fresh database of its own.
func (b *bench) riverBurn(ctx context.Context, name string, workers int) (riverRun, error) {
	var r riverRun
	err := b.scope(func() error {
		_, pool, err := b.e.database(ctx, name, riverPoolConns)
		if err != nil {
			return err
		}
		if err := riverMigrate(ctx, pool); err != nil {
			return err
		}
		r.burnResult, r.conns, err = riverBurnDown(ctx, pool, b.o.burnN, workers)
		return err
	})
	return r, err
}

func (b *bench) submits(ctx context.Context) error {
	return b.scope(func() error {
		s, err := b.e.system(ctx, "bench_submit", b.o.pool)
		if err != nil {
			return err
		}
		before, err := pgCounters(ctx, s.pool)
		if err != nil {
			return err
		}
		perSec, p50, p99, err := s.httpSubmit(b.o.conc, b.o.dur, "demo.noop")
		if err != nil {
			return err
		}
		after, err := pgCounters(ctx, s.pool)
		if err != nil {
			return err
		}
		n := perSec * b.o.dur.Seconds()
		b.vs("Conveyor: submit over HTTP, single", perSec, "tasks/s", "ceiling: submit tx, direct pgx", 0)
		// The same submits against the ceiling in turns, after a warm-up
		// of each, ceiling-HTTP-HTTP-ceiling: the ceilings step ran minutes
		// before this one on a machine whose speed drifts; these turns
		// share the same minute.
		pool, err := b.ceilingDatabase(ctx, "bench_submit_ceiling")
		if err != nil {
			return err
		}
		warm := b.o.dur / 5
		if _, err := submitCeiling(ctx, pool, b.o.conc, warm, false); err != nil {
			return err
		}
		if _, _, _, err := s.httpSubmit(b.o.conc, warm, "demo.noop"); err != nil {
			return err
		}
		// The grouped ceiling is the API's own submit path without HTTP
		// (the submissions of the moment committed together): HTTP's own
		// cost is the ratio to it.
		const each, grouped, viaAPI = 0, 1, 2
		var rates [3]float64
		for _, turn := range []int{each, grouped, viaAPI, viaAPI, grouped, each} {
			cpu := meterCPU(ctx, s.pool)
			var v float64
			var label string
			var err error
			switch turn {
			case viaAPI:
				v, _, _, err = s.httpSubmit(b.o.conc, b.o.dur/2, "demo.noop")
				label = "single submit over HTTP"
			case grouped:
				v, err = submitCeiling(ctx, pool, b.o.conc, b.o.dur/2, true)
				label = "submit ceiling, direct pgx, grouped commits"
			default:
				v, err = submitCeiling(ctx, pool, b.o.conc, b.o.dur/2, false)
				label = "submit ceiling, direct pgx"
			}
			if err != nil {
				return err
			}
			cpu(label, v*(b.o.dur/2).Seconds())
			rates[turn] += v / 2
		}
		b.add(result{Name: "ceiling: submit tx, direct pgx, in turns with HTTP", Value: rates[each], Unit: "tasks/s"})
		b.add(result{Name: "ceiling: the API's submit path, direct pgx, grouped commits, in turns with HTTP",
			Value: rates[grouped], Unit: "tasks/s"})
		b.vs("Conveyor: submit over HTTP, single, in turns with the ceiling", rates[viaAPI], "tasks/s",
			"ceiling: submit tx, direct pgx, in turns with HTTP", 0.75)
		b.vs("Conveyor: submit over HTTP, single, of the same path without HTTP", rates[viaAPI], "tasks/s",
			"ceiling: the API's submit path, direct pgx, grouped commits, in turns with HTTP", 0)
		// Authentication's cost: the same submits to an api that lets
		// everyone in (AUTH_DISABLED). The two take turns, on-off-off-on
		// twice, a quarter of the duration each, so that neither gains
		// from going first or last, nor from the minute it ran in (this
		// machine's speed moves within a minute).
		off, err := b.e.system(ctx, "bench_submit_noauth", b.o.pool, "AUTH_DISABLED=true")
		if err != nil {
			return err
		}
		var on, offSum float64
		for _, sys := range []*system{s, off, off, s, s, off, off, s} {
			v, _, _, err := sys.httpSubmit(b.o.conc, b.o.dur/4, "demo.noop")
			if err != nil {
				return err
			}
			if sys == s {
				on += v / 4
			} else {
				offSum += v / 4
			}
		}
		off.procs["api"].stop()
		b.add(result{Name: "Conveyor: submit over HTTP, single, auth off", Value: offSum, Unit: "tasks/s"})
		b.vs("Conveyor: submit over HTTP, single, auth on", on, "tasks/s", "Conveyor: submit over HTTP, single, auth off", 0.9)
		b.add(result{Name: "Conveyor: submit over HTTP, p50", Value: ms(p50), Unit: "ms"})
		b.add(result{Name: "Conveyor: submit over HTTP, p99", Value: ms(p99), Unit: "ms"})
		b.add(result{Name: "Conveyor: write transactions per single submit", Value: float64(after.commits-before.commits) / n, Unit: "txs"})
		b.add(result{Name: "Conveyor: WAL per single submit", Value: float64(after.wal-before.wal) / n, Unit: "bytes"})
		v, err := s.httpBatch(4, 500, b.o.dur)
		if err != nil {
			return err
		}
		b.vs("Conveyor: submit over HTTP, batches of 500", v, "tasks/s", "ceiling: submit tx, direct pgx", 0)
		// The batches again in turns with the ceiling, ceiling-batch-
		// batch-ceiling, for the same reason as the single submits.
		var batches, ceiling float64
		for i, turn := range []bool{false, true, true, false} {
			cpu := meterCPU(ctx, s.pool)
			if turn {
				v, err = s.httpBatch(4, 500, b.o.dur/2)
				cpu("batch submits over HTTP", v*(b.o.dur/2).Seconds())
				batches += v / 2
			} else {
				v, err = submitCeiling(ctx, pool, b.o.conc, b.o.dur/2, false)
				cpu(fmt.Sprintf("submit ceiling, direct pgx (turn %d)", i+1), v*(b.o.dur/2).Seconds())
				ceiling += v / 2
			}
			if err != nil {
				return err
			}
		}
		b.add(result{Name: "ceiling: submit tx, direct pgx, in turns with batches", Value: ceiling, Unit: "tasks/s"})
		b.vs("Conveyor: submit over HTTP, batches of 500, in turns with the ceiling", batches, "tasks/s",
			"ceiling: submit tx, direct pgx, in turns with batches", 2)
		b.add(result{Name: "Conveyor: api RSS after submits", Value: mib(s.procs["api"].rss()), Unit: "MiB"})
		return nil
	})
}

func (b *bench) relay(ctx context.Context) error {
	// Message for message against the bare publisher (one task a message,
	// as the relay publishes a trickle), in turns, each run on a fresh
	// vhost (the relay's on a fresh database too), keeping each one's
	// best: the ceilings step's publisher ran minutes earlier, on another
	// draw of the machine.
	const bare, relay = 0, 1
	var rss int64
	best, err := sweep(b.o.burnTries, 2, func(v float64) float64 { return v },
		func(i, try int) (float64, error) {
			if i == relay {
				perSec, peak, err := b.relayRun(ctx, fmt.Sprintf("bench_relay_%d", try), 1, unpacked)
				rss = max(rss, peak)
				return perSec, err
			}
			var perSec float64
			err := b.scope(func() error {
				amqpURL, err := b.e.vhost(fmt.Sprintf("bench_relay_bare_%d", try))
				if err != nil {
					return err
				}
				perSec, err = publishCeiling(amqpURL, b.o.messages, 500)
				return err
			})
			return perSec, err
		})
	if err != nil {
		return err
	}
	const ceiling = "ceiling: publish, bare amqp091 (confirms, 500/batch), in turns with the relay"
	b.add(result{Name: ceiling, Value: best[bare], Unit: "msgs/s"})
	b.vs("Conveyor: relay publish throughput", best[relay], "msgs/s", ceiling, 0.8)
	b.last().Config = unpacked
	b.add(result{Name: "Conveyor: relay peak RSS (publishing)", Value: mib(rss), Unit: "MiB"})

	// The same relay with one lane: what keeping batches in flight on
	// several connections at once is worth.
	perSec, _, err := b.relayRun(ctx, "bench_relay_one_lane", 1, "RELAY_LANES=1", unpacked)
	if err != nil {
		return err
	}
	b.vs("Conveyor: relay publish throughput, one lane", perSec, "msgs/s", "Conveyor: relay publish throughput", 0)
	b.last().Config = unpacked

	// And as installed: the backlog's tasks packed.
	if perSec, _, err = b.relayRun(ctx, "bench_relay_packed", 1); err != nil {
		return err
	}
	b.vs("Conveyor: relay publish throughput, tasks packed (defaults)", perSec, "tasks/s", "Conveyor: relay publish throughput", 0)
	return nil
}

// relayRun publishes -messages outbox rows with relays relay processes
// on a fresh system named name, torn down after, and returns the rate
// and the first relay's peak RSS.
func (b *bench) relayRun(ctx context.Context, name string, relays int, vars ...string) (perSec float64, rss int64, err error) {
	err = b.scope(func() error {
		s, err := b.e.system(ctx, name, b.o.pool)
		if err != nil {
			return err
		}
		var peak map[string]int64
		perSec, peak, err = s.relayThroughput(ctx, b.o.messages, relays, vars...)
		rss = peak["relay"]
		return err
	})
	return perSec, rss, err
}

// burnDown measures one worker process burning down n tasks at each tuned
// concurrency, picks the best, and then runs it head to head with the
// default configuration, River's best and the bare consumer at its
// prefetch (headToHead): Conveyor's figure is the best tuned one there,
// set against each of the others.
func (b *bench) burnDown(ctx context.Context) error {
	configs := make([]burnConfig, len(b.o.conveyorWorkers))
	for i, c := range b.o.conveyorWorkers {
		configs[i] = burnConfig{name: fmt.Sprintf("bench_burn_%d", c), n: b.o.burnN, procs: 1, concurrency: c}
	}
	runs, err := b.conveyorSweep(ctx, configs)
	if err != nil {
		return err
	}
	var swept float64
	var bestConc int
	for i, c := range b.o.conveyorWorkers {
		b.add(result{Name: fmt.Sprintf("Conveyor: burn-down, WORKER_CONCURRENCY %d (prefetch %d)", c, workerPrefetch(c)), Value: runs[i].perSec, Unit: "tasks/s"})
		if runs[i].perSec > swept {
			swept, bestConc = runs[i].perSec, c
		}
	}
	prefetch := workerPrefetch(bestConc)
	if err := b.consumeCeilings(ctx, prefetch); err != nil {
		return err
	}
	h, err := b.headToHead(ctx, bestConc)
	if err != nil {
		return err
	}
	config := fmt.Sprintf("WORKER_CONCURRENCY %d, prefetch %d", bestConc, prefetch)
	const (
		name  = "Conveyor: burn-down of demo.noop tasks"
		river = "head to head: River's best"
		bare  = "head to head: bare consumer at the best's prefetch (acks)"
	)
	if h.river > 0 {
		b.add(result{Name: river, Value: h.river, Unit: "jobs/s", Config: fmt.Sprintf("MaxWorkers %d", b.riverBest)})
	}
	b.add(result{Name: bare, Value: h.bare, Unit: "msgs/s", Config: fmt.Sprintf("prefetch %d", prefetch)})
	for _, l := range []struct {
		name, baseline string
		min            float64
	}{
		{name, river, 0.5},
		{name + ", vs bare consumer", bare, 0.8},
		{name + ", vs bare consumer's multiple acks", consumeCeilingName(prefetch, true), 0},
	} {
		b.vs(l.name, h.best.perSec, "tasks/s", l.baseline, l.min)
		b.last().Config = config
	}
	if h.river > 0 {
		// What the bare consumer's target asks, set beside a peer that
		// keeps its jobs in PostgreSQL and has no broker in its path.
		b.vs(river+", vs bare consumer (jobs against messages)", h.river, "jobs/s", bare, 0)
		b.last().Config = fmt.Sprintf("MaxWorkers %d", b.riverBest)
	}
	b.vs("Conveyor: burn-down, default configuration", h.def.perSec, "tasks/s", name, 0.8)
	b.last().Config = fmt.Sprintf("defaults: WORKER_CONCURRENCY %d, prefetch %d", h.def.concurrency, workerPrefetch(h.def.concurrency))
	const fifo = "Conveyor: burn-down, default configuration, queues without priorities"
	b.vs(fifo, h.fifo.perSec, "tasks/s", "Conveyor: burn-down, default configuration", 0)
	b.last().Config = noPriorities
	if h.river > 0 {
		b.vs(fifo+", vs River's best", h.fifo.perSec, "tasks/s", river, 0)
		b.last().Config = noPriorities
	}
	b.vs("Conveyor: write transactions per task (burn-down)", h.best.commits, "txs", "River: write transactions per job (burn-down)", 0)
	b.last().Config = config
	b.vs("Conveyor: WAL per task (burn-down)", h.best.wal, "bytes", "River: WAL per job (burn-down)", 0)
	b.last().Config = config
	b.add(result{Name: "Conveyor: worker peak RSS (burn-down)", Value: mib(h.best.rss), Unit: "MiB", Config: config})
	return nil
}

// headToHeadResult is the head-to-head's figure of each entrant.
type headToHeadResult struct {
	best, def conveyorBurnResult
	// fifo is the default configuration on queues without priorities.
	fifo  conveyorBurnResult
	river float64 // 0: the river step did not run
	bare  float64
}

// headToHead runs the burn-down's entrants in turns, the same backlog
// each: Conveyor at the sweep's best concurrency, Conveyor as installed
// (no variable set), the same on queues without priorities
// (AMQP_MAX_PRIORITY=0), River at its sweep's best, and the bare consumer
// draining a queue at the best's prefetch, acking each message. Each runs
// -burn-tries times (A B C D, D C B A, ...) and keeps its best; the bare
// consumer drains bareDrains times in each of its turns.
//
// The sweeps only pick the configurations. A sweep's best figure is the
// luckiest of all its configurations' draws, and the sweeps and the
// ceilings run minutes apart on a machine whose speed drifts: set against
// each other, they favour whichever had more draws or the better minutes.
// Here every entrant has as many draws as the others, over the same
// minutes, and the ratios with targets are taken between them.
// bareDrains is how many drains the bare consumer makes in each turn of
// a head to head. Its drain lands in the broker's fast state or its slow
// one by the queue process's heap, not by the machine's minute (about one
// in three fast in runs AN and AO): with one drain a turn, a run of two
// turns drew only slow ones half the time, and set Conveyor against the
// broker held back. A drain takes about a second.
const bareDrains = 3

func (b *bench) headToHead(ctx context.Context, conc int) (headToHeadResult, error) {
	var h headToHeadResult
	type entrant func(try int) (float64, error)
	entrants := []entrant{
		func(try int) (float64, error) {
			r, err := b.conveyorBurn(ctx, fmt.Sprintf("bench_h2h_%d_%d", conc, try), b.o.burnN, 1, conc)
			if err == nil && r.perSec > h.best.perSec {
				h.best = r
			}
			return r.perSec, err
		},
		func(try int) (float64, error) {
			r, err := b.conveyorBurn(ctx, fmt.Sprintf("bench_h2h_default_%d", try), b.o.burnN, 1, 0)
			if err == nil && r.perSec > h.def.perSec {
				h.def = r
			}
			return r.perSec, err
		},
		func(try int) (float64, error) {
			r, err := b.conveyorBurn(ctx, fmt.Sprintf("bench_h2h_fifo_%d", try), b.o.burnN, 1, 0, noPriorities)
			if err == nil && r.perSec > h.fifo.perSec {
				h.fifo = r
			}
			return r.perSec, err
		},
		func(int) (float64, error) {
			// The broker drains the same backlog in a fast state or a
			// slow one, by chance (docs/performance.md, ninth round):
			// several drains a turn, so that its best is its figure.
			best := 0.0
			err := b.scope(func() error {
				amqpURL, err := b.e.vhost("bench_h2h_consume")
				if err != nil {
					return err
				}
				for range bareDrains {
					v, err := consumeCeiling(ctx, amqpURL, b.o.burnN, workerPrefetch(conc), 1)
					if err != nil {
						return err
					}
					best = max(best, v)
				}
				return nil
			})
			h.bare = max(h.bare, best)
			return best, err
		},
	}
	if b.riverBest > 0 {
		entrants = append(entrants, func(try int) (float64, error) {
			r, err := b.riverBurn(ctx, fmt.Sprintf("bench_h2h_river_%d", try), b.riverBest)
			h.river = max(h.river, r.perSec)
			return r.perSec, err
		})
	}
	_, err := sweep(b.o.burnTries, len(entrants), func(v float64) float64 { return v },
		func(i, try int) (float64, error) { return entrants[i](try) })
	return h, err
}

// conveyorBurnResult is a burn-down of Conveyor's, with the first
// worker's peak RSS and its concurrency as it registered it (the default's
// when none was set).
type conveyorBurnResult struct {
	burnResult
	rss         int64
	concurrency int
}

// burnConfig is a configuration of a burn-down sweep: procs worker
// processes of concurrency slots each (0: the defaults), vars added to
// their environment.
type burnConfig struct {
	name               string
	n                  int // tasks in the backlog
	procs, concurrency int
	vars               []string
}

// tryOrder is the order in which a sweep of n configurations runs them in
// its try-th round: forward, then backward (A B C, C B A, ...), so that no
// configuration always runs right after another step's load or always
// last.
func tryOrder(n, try int) []int {
	order := make([]int, n)
	for i := range order {
		order[i] = i
		if try%2 == 1 {
			order[i] = n - 1 - i
		}
	}
	return order
}

// sweep runs each of n configurations -burn-tries times, in turns (see
// tryOrder), and returns the best run of each, by perSec; run gets the
// configuration's index and the try.
func sweep[R any](tries, n int, perSec func(R) float64, run func(i, try int) (R, error)) ([]R, error) {
	best := make([]R, n)
	for try := range tries {
		for _, i := range tryOrder(n, try) {
			r, err := run(i, try)
			if err != nil {
				return nil, err
			}
			if try == 0 || perSec(r) > perSec(best[i]) {
				best[i] = r
			}
		}
	}
	return best, nil
}

// conveyorSweep sweeps Conveyor's burn-down configurations.
func (b *bench) conveyorSweep(ctx context.Context, configs []burnConfig) ([]conveyorBurnResult, error) {
	return sweep(b.o.burnTries, len(configs), func(r conveyorBurnResult) float64 { return r.perSec },
		func(i, try int) (conveyorBurnResult, error) {
			c := configs[i]
			return b.conveyorBurn(ctx, fmt.Sprintf("%s_%d", c.name, try), c.n, c.procs, c.concurrency, c.vars...)
		})
}

// conveyorBurn runs one burn-down of n tasks on a system of its own: procs
// workers with concurrency slots each (0: the defaults) and one relay.
func (b *bench) conveyorBurn(ctx context.Context, name string, n, procs, concurrency int, vars ...string) (conveyorBurnResult, error) {
	return b.burnOn(ctx, name, func(s *system) error {
		if err := s.declareFor(vars); err != nil {
			return err
		}
		return s.startRelay()
	}, func(s *system) (burnResult, error) {
		return s.burnDown(ctx, n, procs, concurrency, vars...)
	})
}

// burnOn runs one burn-down on a system of its own: prepare readies the
// system (queues, relays), burn burns the backlog down; the first worker's
// peak RSS and the workers' concurrency come with its figures.
func (b *bench) burnOn(ctx context.Context, name string, prepare func(*system) error,
	burn func(*system) (burnResult, error)) (conveyorBurnResult, error) {
	var r conveyorBurnResult
	err := b.scope(func() error {
		s, err := b.e.system(ctx, name, b.o.pool)
		if err != nil {
			return err
		}
		if err := prepare(s); err != nil {
			return err
		}
		stop := s.sampleRSS("worker-0")
		r.burnResult, err = burn(s)
		r.rss = stop()["worker-0"]
		if err != nil {
			return err
		}
		return s.pool.QueryRow(ctx, `SELECT coalesce(max(concurrency), 0) FROM workers`).Scan(&r.concurrency)
	})
	return r, err
}

// scaleOutWhy explains the scale-out's target: throughput must not fall as
// processes are added (0.95), less the noise of a run on a shared machine.
const scaleOutWhy = "must not fall as processes are added: 0.95 less noise"

// scaleOut measures whether throughput holds as processes are added: the
// same burn-down (of -scale-n tasks, so that the processes' start, which
// the clock includes, weighs little) with 1, 2 and 4 worker processes in
// the default configuration, and sized for a shared machine (GOMAXPROCS),
// and the same outbox backlog published by 1 and 2 relays.
func (b *bench) scaleOut(ctx context.Context) error {
	workerName := func(n int) string {
		return fmt.Sprintf("Conveyor: burn-down, %d worker %s (default configuration)", n, processes(n))
	}
	counts := []int{1, 2, 4}
	var configs []burnConfig
	for _, n := range counts {
		configs = append(configs, burnConfig{name: fmt.Sprintf("bench_scale_workers_%d", n), n: b.o.scaleN, procs: n})
	}
	// The same, with the processes sized as the README says for several
	// on one machine: the cores shared out between them (GOMAXPROCS), so
	// that their schedulers do not spin for CPUs they do not have.
	sized := []int{2, 4}
	for _, n := range sized {
		configs = append(configs, burnConfig{name: fmt.Sprintf("bench_scale_sized_%d", n), n: b.o.scaleN, procs: n,
			vars: []string{fmt.Sprintf("GOMAXPROCS=%d", max(1, runtime.NumCPU()/n))}})
	}
	runs, err := b.conveyorSweep(ctx, configs)
	if err != nil {
		return err
	}
	for i, n := range counts {
		if n == 1 {
			b.add(result{Name: workerName(n), Value: runs[i].perSec, Unit: "tasks/s"})
			continue
		}
		b.vs(workerName(n), runs[i].perSec, "tasks/s", workerName(1), 0)
		b.last().atLeast(0.9, scaleOutWhy)
	}
	for i, n := range sized {
		b.vs(fmt.Sprintf("Conveyor: burn-down, %d worker processes, GOMAXPROCS %d each", n, max(1, runtime.NumCPU()/n)),
			runs[len(counts)+i].perSec, "tasks/s", workerName(1), 0)
		b.last().atLeast(0.9, scaleOutWhy)
	}
	relayName := func(n int) string {
		return fmt.Sprintf("Conveyor: relay publish throughput, %d relay %s", n, processes(n))
	}
	// One relay and two in turns, each on a fresh database and keeping
	// its best, as the burn-downs do: one run each, one after the other,
	// set the first's draw of the machine against the second's.
	relays := []int{1, 2}
	best, err := sweep(b.o.burnTries, len(relays), func(v float64) float64 { return v },
		func(i, try int) (float64, error) {
			perSec, _, err := b.relayRun(ctx, fmt.Sprintf("bench_scale_relays_%d_%d", relays[i], try), relays[i], unpacked)
			return perSec, err
		})
	if err != nil {
		return err
	}
	b.add(result{Name: relayName(1), Value: best[0], Unit: "msgs/s"})
	b.vs(relayName(2), best[1], "msgs/s", relayName(1), 0)
	b.last().atLeast(0.9, scaleOutWhy)
	return nil
}

func processes(n int) string {
	if n == 1 {
		return "process"
	}
	return "processes"
}

func (b *bench) latency(ctx context.Context) error {
	err := b.scope(func() error {
		s, err := b.startLatencySystem(ctx, "bench_latency")
		if err != nil {
			return err
		}
		lr, err := s.latency(ctx, b.o.rate, b.o.dur)
		if err != nil {
			return err
		}
		b.atMost(fmt.Sprintf("Conveyor: submit→handler start p50 at %d/s", b.o.rate), ms(lr.p50), "ms", 10)
		b.atMost(fmt.Sprintf("Conveyor: submit→handler start p99 at %d/s", b.o.rate), ms(lr.p99), "ms", 50)
		b.latencyLoad(b.o.rate, lr)
		pub, err := s.relayPublishP50()
		if err != nil {
			return err
		}
		b.atMost("Conveyor: relay commit→publish p50, low load", ms(pub), "ms", 10)
		return nil
	})
	if err != nil {
		return err
	}
	// The same at a quarter of the rate, on a fresh system: how much of
	// the figure above is the queueing of a machine the whole pipeline
	// and its load share.
	quarter := max(b.o.rate/4, 1)
	return b.scope(func() error {
		s, err := b.startLatencySystem(ctx, "bench_latency_low")
		if err != nil {
			return err
		}
		lr, err := s.latency(ctx, quarter, b.o.dur)
		if err != nil {
			return err
		}
		b.add(result{Name: fmt.Sprintf("Conveyor: submit→handler start p50 at %d/s", quarter), Value: ms(lr.p50), Unit: "ms"})
		b.add(result{Name: fmt.Sprintf("Conveyor: submit→handler start p99 at %d/s", quarter), Value: ms(lr.p99), Unit: "ms"})
		b.latencyLoad(quarter, lr)
		return nil
	})
}

// latencyLoad reports what a latency run cost the machine: the share of
// its CPU that was busy while the tasks were submitted, that CPU time per
// task, and PostgreSQL's write transactions per task.
func (b *bench) latencyLoad(rate int, lr latencyResult) {
	b.add(result{Name: fmt.Sprintf("machine: CPU busy while submitting at %d/s", rate), Value: 100 * lr.busy, Unit: "%"})
	b.add(result{Name: fmt.Sprintf("machine: CPU time per task at %d/s", rate),
		Value: lr.busy * float64(runtime.NumCPU()) / float64(rate) * 1e3, Unit: "ms"})
	b.add(result{Name: fmt.Sprintf("Conveyor: write transactions per task at %d/s", rate), Value: lr.txsPerTask, Unit: "txs"})
}

// startLatencySystem starts an API, a relay and a worker of 16 slots on
// fresh scratch databases and vhosts.
func (b *bench) startLatencySystem(ctx context.Context, name string) (*system, error) {
	s, err := b.e.system(ctx, name, b.o.pool)
	if err != nil {
		return nil, err
	}
	if err := s.startRelay(); err != nil {
		return nil, err
	}
	return s, s.startWorker("worker-0", 16)
}

func (b *bench) backlog(ctx context.Context) error {
	peaks := make([]map[string]int64, len(b.o.backlogs))
	for i, n := range b.o.backlogs {
		err := b.scope(func() error {
			s, err := b.e.system(ctx, fmt.Sprintf("bench_backlog_%d", i), b.o.pool)
			if err != nil {
				return err
			}
			if err := s.fillTasks(ctx, n); err != nil {
				return err
			}
			if err := s.startRelay(); err != nil {
				return err
			}
			if err := s.startWorker("worker-0", 16); err != nil {
				return err
			}
			stop := s.sampleRSS("relay", "worker-0")
			time.Sleep(b.o.sampleFor)
			peaks[i] = stop()
			b.add(result{Name: fmt.Sprintf("Conveyor: relay peak RSS, %d backlog", n), Value: mib(peaks[i]["relay"]), Unit: "MiB"})
			b.add(result{Name: fmt.Sprintf("Conveyor: worker peak RSS, %d backlog", n), Value: mib(peaks[i]["worker-0"]), Unit: "MiB"})
			return nil
		})
		if err != nil {
			return err
		}
	}
	last := len(b.o.backlogs) - 1
	small, large := b.o.backlogs[0], b.o.backlogs[last]
	for _, p := range []string{"relay", "worker"} {
		b.vs(fmt.Sprintf("Conveyor: %s peak RSS, %d backlog", p, large), mib(peaks[last][procName(p)]), "MiB",
			fmt.Sprintf("Conveyor: %s peak RSS, %d backlog", p, small), 0)
		r := &b.results[len(b.results)-1]
		met := r.Ratio <= 1.2
		r.Name += " (vs small)"
		r.Target, r.Met = "ratio ≤ 1.20", &met
	}
	return nil
}

func procName(p string) string {
	if p == "worker" {
		return "worker-0"
	}
	return p
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func mib(b int64) float64        { return float64(b) / (1 << 20) }

func machine(ctx context.Context, e *env) map[string]string {
	m := map[string]string{"go": runtime.Version(), "cpus": fmt.Sprint(runtime.NumCPU())}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				m["cpu"] = strings.TrimSpace(strings.SplitN(line, ":", 2)[1])
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		m["memory"] = strings.TrimSpace(strings.TrimPrefix(strings.SplitN(string(b), "\n", 2)[0], "MemTotal:"))
	}
	if c, err := pgx.Connect(ctx, e.adminURL); err == nil {
		var v string
		_ = c.QueryRow(ctx, "SHOW server_version").Scan(&v)
		m["postgresql"] = v
		_ = c.Close(ctx)
	}
	if c, err := amqp.Dial(e.amqpURL); err == nil {
		m["rabbitmq"] = fmt.Sprint(c.Properties["version"])
		_ = c.Close()
	}
	m["rabbitmq_min_bin_vheap_words"] = brokerBinVheap()
	return m
}

func printTable(w io.Writer, rep report) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "measurement\tvalue\tunit\tratio\tbaseline\ttarget\tconfig\n")
	for _, r := range rep.Results {
		ratio, met := "", ""
		if r.Ratio != 0 {
			ratio = fmt.Sprintf("%.2f", r.Ratio)
		}
		if r.Met != nil {
			met = r.Target + map[bool]string{true: " ✓", false: " ✗"}[*r.Met]
		}
		fmt.Fprintf(tw, "%s\t%.1f\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.Value, r.Unit, ratio, r.Baseline, met, r.Config)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\n%s, %s CPUs (%s), %s, PostgreSQL %s, RabbitMQ %s (min_bin_vheap_size %s words); took %s\n", rep.Machine["go"], rep.Machine["cpus"],
		rep.Machine["cpu"], rep.Machine["memory"], rep.Machine["postgresql"], rep.Machine["rabbitmq"],
		rep.Machine["rabbitmq_min_bin_vheap_words"], rep.Duration)
}
