package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// env is what every scenario needs: where the servers are, the built
// binaries, and scratch databases and vhosts that are dropped at the end.
type env struct {
	adminURL string // PostgreSQL, a database to create others from
	amqpURL  string
	bin      string // directory of the built api, relay and worker
	cleanups []func()
}

func (e *env) close() {
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i]()
	}
}

// build compiles the product's binaries (without the race detector).
func (e *env) build() error {
	dir, err := os.MkdirTemp("", "conveyor-bench-bin-")
	if err != nil {
		return err
	}
	e.bin = dir
	e.cleanups = append(e.cleanups, func() { _ = os.RemoveAll(dir) })
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/...")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %w\n%s", err, out)
	}
	return nil
}

// database creates a fresh database and returns its URL and a pool on it.
func (e *env) database(ctx context.Context, name string, maxConns int32) (string, *pgxpool.Pool, error) {
	conn, err := pgx.Connect(ctx, e.adminURL)
	if err != nil {
		return "", nil, err
	}
	defer conn.Close(ctx)
	ident := pgx.Identifier{name}.Sanitize()
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)"); err != nil {
		return "", nil, err
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+ident); err != nil {
		return "", nil, err
	}
	u, err := url.Parse(e.adminURL)
	if err != nil {
		return "", nil, err
	}
	u.Path = "/" + name
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		return "", nil, err
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return "", nil, err
	}
	e.cleanups = append(e.cleanups, func() {
		pool.Close()
		if c, err := pgx.Connect(context.Background(), e.adminURL); err == nil {
			_, _ = c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)")
			_ = c.Close(context.Background())
		}
	})
	return u.String(), pool, nil
}

// vhost creates a fresh RabbitMQ vhost and returns the AMQP URL for it.
func (e *env) vhost(name string) (string, error) {
	_ = exec.Command("rabbitmqctl", "-q", "delete_vhost", name).Run()
	for _, args := range [][]string{{"add_vhost", name}, {"set_permissions", "-p", name, "guest", ".*", ".*", ".*"}} {
		if out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
			return "", fmt.Errorf("rabbitmqctl %v: %w\n%s", args, err, out)
		}
	}
	// BENCH_QUEUE_POLICY, a policy's JSON definition, applies to every
	// queue of the vhost: for measuring the broker's own settings (a lazy
	// queue mode, a queue version) against the same code.
	if pol := os.Getenv("BENCH_QUEUE_POLICY"); pol != "" {
		if out, err := exec.Command("rabbitmqctl", "-q", "set_policy", "-p", name, "bench", ".*", pol, "--apply-to", "queues").CombinedOutput(); err != nil {
			return "", fmt.Errorf("set_policy: %w\n%s", err, out)
		}
	}
	e.cleanups = append(e.cleanups, func() { _ = exec.Command("rabbitmqctl", "-q", "delete_vhost", name).Run() })
	u, err := url.Parse(e.amqpURL)
	if err != nil {
		return "", err
	}
	u.Path = "/" + name
	return u.String(), nil
}

// proc is a running product binary.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
}

// start runs a built binary with env added to the bench's environment.
func (e *env) start(name string, vars ...string) (*proc, error) {
	log, err := os.CreateTemp("", "conveyor-bench-"+name+"-*.log")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(e.bin, strings.SplitN(name, "-", 2)[0]))
	cmd.Env = append(append(inherited(), "LOG_LEVEL=warn", "LOG_FORMAT=text"), vars...)
	cmd.Stdout, cmd.Stderr = log, log
	// The process dies with the bench, however the bench ends: one left
	// running (a bench stopped by a signal) would join the next run's
	// system of the same name and take its tasks.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{name: name, cmd: cmd, log: log}
	e.cleanups = append(e.cleanups, p.stop)
	return p, nil
}

// benchOwned are the product's (and the Go runtime's) settings the bench
// decides for each process, or leaves unset to measure the defaults: a
// value in the bench's own environment must not leak into either.
var benchOwned = []string{"WORKER_CONCURRENCY", "WORKER_READ_AHEAD", "WORKER_WRITE_FLIGHTS", "GOMAXPROCS", "GOGC"}

// inherited is the bench's environment without the settings it owns.
func inherited() []string {
	return slices.DeleteFunc(os.Environ(), func(kv string) bool {
		name, _, _ := strings.Cut(kv, "=")
		return slices.Contains(benchOwned, name)
	})
}

func (p *proc) stop() {
	if p.cmd.ProcessState == nil {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
	}
	_ = p.log.Close()
	_ = os.Remove(p.log.Name())
}

// rss is the process's resident set size in bytes.
func (p *proc) rss() int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			f := strings.Fields(line)
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb * 1024
		}
	}
	return 0
}

// waitHTTP waits until url answers 200.
func waitHTTP(url string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %s (last error: %w)", url, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitFor polls cond until it holds.
func waitFor(timeout time.Duration, interval time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s", timeout)
		}
		time.Sleep(interval)
	}
}

// freeAddr returns a loopback address with a free port.
func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// dbNow reads the database's clock, which burn-downs time themselves by.
func dbNow(ctx context.Context, pool *pgxpool.Pool) (time.Time, error) {
	var t time.Time
	err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&t)
	return t, err
}

// burnPoll is how often a burn-down asks whether any of its work is left.
// The time is taken from the rows themselves, so the poll only decides
// when the bench goes on.
const burnPoll = 250 * time.Millisecond

// awaitBurnDown waits until left (a query of one boolean) finds no work
// left, checks that countDone reaches n, and returns the time from start to
// the last finish that lastDone reads, both on the database's clock. Asking
// whether any work is left stops at the first open row an index holds;
// counting the finished rows read every one of them, and at 250 ms took
// 5–15% of a core from the burn-down it measured.
func awaitBurnDown(ctx context.Context, pool *pgxpool.Pool, n int, start time.Time, left, countDone, lastDone string) (time.Duration, error) {
	err := waitFor(5*time.Minute, burnPoll, func() (bool, error) {
		var open bool
		err := pool.QueryRow(ctx, left).Scan(&open)
		return !open, err
	})
	if err != nil {
		return 0, err
	}
	var done int
	if err := pool.QueryRow(ctx, countDone).Scan(&done); err != nil {
		return 0, err
	}
	if done < n {
		return 0, fmt.Errorf("no work left, but %d of %d finished", done, n)
	}
	var last time.Time
	if err := pool.QueryRow(ctx, lastDone).Scan(&last); err != nil {
		return 0, err
	}
	return last.Sub(start), nil
}

// brokerBinVheap is the default binary virtual heap size of the broker's
// Erlang processes, in words ("?" when rabbitmqctl cannot tell): it
// decides which of the broker's two regimes a burn-down's queue drains
// in, so a figure means little without it (see docs/performance.md,
// "Thirteenth round").
func brokerBinVheap() string {
	out, err := exec.Command("rabbitmqctl", "-q", "eval", "erlang:system_info(min_bin_vheap_size).").Output()
	if err != nil {
		return "?"
	}
	if m := regexp.MustCompile(`\d+`).FindString(string(out)); m != "" {
		return m
	}
	return "?"
}
