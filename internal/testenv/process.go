package testenv

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildMu    sync.Mutex
	buildCache = map[string]string{}
)

// Binary builds the command at pkg (such as "./cmd/api", relative to the
// module root) once per test process and returns the path of the binary.
func Binary(t testing.TB, pkg string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if path, ok := buildCache[pkg]; ok {
		return path
	}
	dir, err := os.MkdirTemp("", "conveyor-bin-")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	out := filepath.Join(dir, filepath.Base(pkg))
	args := []string{"build", "-o", out}
	if raceEnabled {
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, pkg)...)
	cmd.Dir = ModuleRoot(t)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("testenv: go build %s: %v\n%s", pkg, err, b)
	}
	buildCache[pkg] = out
	return out
}

// ModuleRoot is the directory holding go.mod.
func ModuleRoot(t testing.TB) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Process is a started binary whose output is kept for assertions and
// printed when the test fails.
type Process struct {
	Name string
	cmd  *exec.Cmd
	out  *SyncBuffer
	done chan struct{}
	err  error
}

// Start runs the binary with env added to the test's environment. The
// process is killed when t ends.
func Start(t testing.TB, name, binary string, env ...string) *Process {
	t.Helper()
	p := &Process{Name: name, out: &SyncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(binary)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("testenv: start %s: %v", name, err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.Signal(syscall.SIGKILL)
		<-p.done
		if strings.Contains(p.Output(), "WARNING: DATA RACE") {
			t.Errorf("testenv: %s reported a data race", name)
		}
		if t.Failed() {
			t.Logf("--- output of %s:\n%s", name, p.Output())
		}
	})
	return p
}

// Signal sends sig to the process, if it still runs.
func (p *Process) Signal(sig syscall.Signal) {
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(sig)
	}
}

// Wait waits up to timeout for the process to exit and returns its exit code.
func (p *Process) Wait(t testing.TB, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(timeout):
		t.Fatalf("testenv: %s still running after %s", p.Name, timeout)
	}
	if p.cmd.ProcessState == nil {
		return -1
	}
	return p.cmd.ProcessState.ExitCode()
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Output is everything the process printed so far.
func (p *Process) Output() string { return p.out.String() }

// FreeAddr returns a 127.0.0.1 address with a port free at the time of the call.
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// FreePort returns a free TCP port on 127.0.0.1.
func FreePort(t testing.TB) int {
	_, port, _ := net.SplitHostPort(FreeAddr(t))
	n, _ := strconv.Atoi(port)
	return n
}

// Eventually polls cond every interval until it returns nil or timeout
// passes, then fails the test with the last error.
func Eventually(t testing.TB, timeout time.Duration, cond func() error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var err error
	for {
		if err = cond(); err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("condition not met within %s: %v", timeout, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// WaitHTTP waits until url answers 200.
func WaitHTTP(t testing.TB, url string, timeout time.Duration) {
	t.Helper()
	Eventually(t, timeout, func() error { return WantStatus(url, http.StatusOK) })
}

// WantStatus GETs url and says how its status differs from status.
func WantStatus(url string, status int) error {
	resp, err := http.Get(url) //nolint:noctx // a probe, bounded by its caller
	if err != nil {
		return err
	}
	_ = resp.Body.Close()
	if resp.StatusCode != status {
		return fmt.Errorf("%s: %s, want %d", url, resp.Status, status)
	}
	return nil
}

// SyncBuffer is an output that tests read while a process writes it.
type SyncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// SilentAddr is the address of a listener that takes connections and
// never answers on them (a server that hangs, a load balancer with nothing
// behind it), until the test ends; accepted counts the connections it took.
func SilentAddr(t testing.TB) (addr string, accepted func() int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: listen: %v", err)
	}
	var mu sync.Mutex
	var held []net.Conn
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			_ = c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	return ln.Addr().String(), func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(held)
	}
}
