package testenv

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/postgres"
)

// Private servers are for tests that stop, restart or block a server: they
// must never touch the shared ones other tests use.

// PGServer is a private PostgreSQL cluster on its own port and data
// directory, run as the postgres user.
type PGServer struct {
	Port int
	dir  string
	// settings are the server's -c settings beyond the defaults.
	settings []string
}

const pgBin = "/usr/lib/postgresql/15/bin"

// StartPG initialises and starts a private PostgreSQL, removed when t ends.
// It syncs nothing to disk (fsync and synchronous_commit off), which a test
// that stops the server cleanly never notices; settings ("name=value")
// override those and add others.
func StartPG(t testing.TB, settings ...string) *PGServer {
	t.Helper()
	dir := ownedTempDir(t, "postgres")
	s := &PGServer{Port: FreePort(t), dir: dir, settings: settings}
	asUser(t, "postgres", filepath.Join(pgBin, "initdb"), "-D", s.dataDir(), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
	s.Start(t)
	t.Cleanup(func() {
		s.Crash(t)
		_ = os.RemoveAll(dir)
	})
	return s
}

func (s *PGServer) dataDir() string { return filepath.Join(s.dir, "data") }

// URL connects to database on the private server.
func (s *PGServer) URL(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.Port, database)
}

// Start starts the server and waits until it accepts connections.
func (s *PGServer) Start(t testing.TB) {
	t.Helper()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off", s.Port, s.dir)
	for _, setting := range s.settings {
		opts += " -c " + setting
	}
	asUser(t, "postgres", filepath.Join(pgBin, "pg_ctl"), "-D", s.dataDir(), "-o", opts, "-l", filepath.Join(s.dir, "log"), "-w", "-t", "60", "start")
}

// Stop shuts the server down fast (clients are disconnected).
func (s *PGServer) Stop(t testing.TB) {
	t.Helper()
	s.stop(t, "fast")
}

// Crash stops the server as a crash would: every process quits at once,
// and what sat in its shared memory (the WAL not yet written out among
// it) is gone. The next Start recovers from the WAL on disk.
func (s *PGServer) Crash(t testing.TB) {
	t.Helper()
	s.stop(t, "immediate")
}

func (s *PGServer) stop(t testing.TB, mode string) {
	t.Helper()
	out, err := exec.Command("runuser", "-u", "postgres", "--", filepath.Join(pgBin, "pg_ctl"),
		"-D", s.dataDir(), "-m", mode, "-w", "stop").CombinedOutput()
	if err != nil {
		t.Logf("testenv: pg_ctl stop: %v\n%s", err, out)
	}
}

// RabbitNode is a private RabbitMQ node with its own name, ports and data.
type RabbitNode struct {
	Name string
	Port int
	dir  string
	env  []string
	// killAtCleanup: the node is killed when the test ends, not stopped.
	killAtCleanup bool
}

// StartRabbit starts a private RabbitMQ node, stopped and removed when t
// ends. Starting takes a few seconds.
func StartRabbit(t testing.TB) *RabbitNode {
	t.Helper()
	n := newRabbitNode(t)
	n.Start(t)
	return n
}

// newRabbitNode prepares a private node, not started yet: its name, ports,
// configuration and data directories (owned by the rabbitmq user, as the
// server runs as that user). The node is stopped and its files removed
// when t ends.
func newRabbitNode(t testing.TB) *RabbitNode {
	t.Helper()
	dir := ownedTempDir(t, "rabbitmq")
	n := &RabbitNode{Name: "conveyor_test_" + randomSuffix() + "@localhost", Port: FreePort(t), dir: dir}
	conf := filepath.Join(dir, "rabbitmq")
	writeFile(t, conf+".conf", fmt.Sprintf("listeners.tcp.default = 127.0.0.1:%d\nloopback_users = none\n", n.Port))
	writeFile(t, filepath.Join(dir, "rabbitmq-env.conf"), "")
	writeFile(t, filepath.Join(dir, "enabled_plugins"), "[].\n")
	n.env = []string{
		"RABBITMQ_NODENAME=" + n.Name,
		"RABBITMQ_NODE_PORT=" + strconv.Itoa(n.Port),
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(FreePort(t)),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(dir, "rabbitmq-env.conf"),
		"RABBITMQ_CONFIG_FILE=" + conf,
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(dir, "log"),
		"RABBITMQ_PID_FILE=" + n.pidFile(),
		"ERL_EPMD_ADDRESS=127.0.0.1",
	}
	for _, sub := range []string{"mnesia", "log"} {
		mkdirOwned(t, filepath.Join(dir, sub), "rabbitmq")
	}
	t.Cleanup(func() {
		if n.killAtCleanup {
			_ = n.kill()
		} else {
			_ = n.ctl("stop")
		}
		_ = os.RemoveAll(dir)
	})
	return n
}

// pidFile is where the node writes the process id of its Erlang VM.
func (n *RabbitNode) pidFile() string { return filepath.Join(n.dir, "pid") }

// URL is the node's AMQP URL.
func (n *RabbitNode) URL() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.Port) }

// Start starts the node and waits until it serves.
func (n *RabbitNode) Start(t testing.TB) {
	t.Helper()
	n.launch(t)
	n.awaitStartup(t)
}

// launch starts the node's VM in the background; it is not serving yet.
func (n *RabbitNode) launch(t testing.TB) {
	t.Helper()
	cmd := exec.Command("rabbitmq-server", "-detached")
	cmd.Env = append(os.Environ(), n.env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("testenv: start rabbitmq node: %v\n%s", err, out)
	}
}

// awaitStartup waits until a launched node serves.
func (n *RabbitNode) awaitStartup(t testing.TB) {
	t.Helper()
	// -detached returns before the node is up. Its AMQP listener opens
	// last of all, and trying the port is cheap, where each rabbitmqctl
	// starts an Erlang VM (a second of CPU that the booting nodes want):
	// wait for the port, then make sure the node answers and that the
	// broker inside it has finished booting.
	deadline := time.Now().Add(90 * time.Second)
	for !listening(n.Port) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	for n.ctl("ping") != nil {
		if time.Now().After(deadline) {
			t.Fatalf("testenv: rabbitmq node %s did not start:\n%s", n.Name, n.logTail())
		}
		time.Sleep(200 * time.Millisecond)
	}
	// A node that answers may still be booting or, right after a stop,
	// still shutting down: ask again until the broker itself runs.
	for {
		err := n.ctl("await_startup", "--timeout", "30")
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("testenv: rabbitmq node %s did not start: %v", n.Name, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// listening says whether something accepts connections on the port.
func listening(port int) bool {
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), time.Second)
	if err != nil {
		return false
	}
	_ = c.Close()
	return true
}

// logTail is the end of the node's log, for failures.
func (n *RabbitNode) logTail() string {
	logs, _ := os.ReadFile(filepath.Join(n.dir, "log", strings.TrimSuffix(n.Name, "@localhost")+"@localhost.log"))
	return tail(string(logs), 3000)
}

// Stop stops the node (the whole Erlang VM); Start brings it back with its
// durable queues and persistent messages.
func (n *RabbitNode) Stop(t testing.TB) {
	t.Helper()
	// With the pid file, rabbitmqctl waits until the VM has exited, so a
	// Start right after cannot meet the old node still shutting down.
	if err := n.ctl("stop", n.pidFile()); err != nil {
		t.Fatalf("testenv: stop rabbitmq node: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for n.ctl("ping") == nil {
		if time.Now().After(deadline) {
			t.Fatalf("testenv: rabbitmq node %s still answers after stop", n.Name)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Ctl runs rabbitmqctl against the node.
func (n *RabbitNode) Ctl(t testing.TB, args ...string) string {
	t.Helper()
	cmd := exec.Command("rabbitmqctl", append([]string{"-q", "-n", n.Name}, args...)...)
	cmd.Env = append(os.Environ(), n.env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("testenv: rabbitmqctl %v: %v\n%s", args, err, out)
	}
	return string(out)
}

func (n *RabbitNode) ctl(args ...string) error {
	cmd := exec.Command("rabbitmqctl", append([]string{"-q", "-n", n.Name}, args...)...)
	cmd.Env = append(os.Environ(), n.env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, out)
	}
	return nil
}

func ownedTempDir(t testing.TB, owner string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "conveyor-"+owner+"-")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	chown(t, dir, owner)
	return dir
}

func mkdirOwned(t testing.TB, dir, owner string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("testenv: %v", err)
	}
	chown(t, dir, owner)
}

func chown(t testing.TB, path, owner string) {
	t.Helper()
	u, err := user.Lookup(owner)
	if err != nil {
		t.Skipf("testenv: no %s user on this machine: %v", owner, err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(path, uid, gid); err != nil {
		t.Fatalf("testenv: chown %s: %v", path, err)
	}
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatalf("testenv: %v", err)
	}
}

func asUser(t testing.TB, user string, args ...string) {
	t.Helper()
	out, err := exec.Command("runuser", append([]string{"-u", user, "--"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("testenv: %v: %v\n%s", args, err, out)
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// Migrated creates database on the private server, applies Conveyor's
// migrations, and returns its URL and a pool on it (closed when t ends).
func (s *PGServer) Migrated(t testing.TB, database string) (string, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	url := s.URL(database)
	if err := postgres.EnsureDatabaseURL(ctx, url); err != nil {
		t.Fatalf("testenv: create %s: %v", url, err)
	}
	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url, MaxConns: 4})
	if err != nil {
		t.Fatalf("testenv: open %s: %v", url, err)
	}
	t.Cleanup(pool.Close)
	if _, err := postgres.Migrate(ctx, pool, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatalf("testenv: migrate %s: %v", url, err)
	}
	return url, pool
}
