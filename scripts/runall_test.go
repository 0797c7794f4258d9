// Package scripts holds the tests of the repository's shell scripts.
package scripts

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// An API that cannot start (its port taken, a bad variable) ends `make run`
// with its status before the relay and the worker start, and the banner
// that says the pipeline runs, with the key to use, is never printed: a
// reader of the README once saw "conveyor running" above the API's own
// "address already in use".
func TestRunAllStopsWhenTheAPIExitsBeforeItIsReady(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("run-all.sh needs curl")
	}
	script, err := filepath.Abs("run-all.sh")
	require.NoError(t, err)
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	require.NoError(t, os.Mkdir(bin, 0o755))
	// Stand-ins for the binaries: the API migrates and bootstraps, then
	// fails as one whose port is taken; the others leave a mark if started.
	fake := map[string]string{
		"api": `case "$1" in
  migrate) exit 0 ;;
  bootstrap) echo cvk_fake_key; exit 0 ;;
esac
echo 'conveyor-api: listen on API_ADDR: bind: address already in use' >&2
exit 3
`,
		"relay":  "touch \"$MARKS/relay\"\nexec sleep 60\n",
		"worker": "touch \"$MARKS/worker\"\nexec sleep 60\n",
	}
	for name, body := range fake {
		require.NoError(t, os.WriteFile(filepath.Join(bin, name), []byte("#!/usr/bin/env bash\n"+body), 0o755))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", script, filepath.Join(bin, "api"), filepath.Join(bin, "relay"), filepath.Join(bin, "worker"))
	cmd.Dir = dir
	// Nothing listens on API_ADDR, so /readyz never answers.
	cmd.Env = append(os.Environ(), "API_ADDR="+testenv.FreeAddr(t), "MARKS="+dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	require.NoError(t, ctx.Err(), "run-all.sh did not stop:\n%s", out.String())
	ee, ok := errors.AsType[*exec.ExitError](err)
	require.True(t, ok, "run-all.sh exited 0:\n%s", out.String())
	require.Equal(t, 3, ee.ExitCode(), "the API's status:\n%s", out.String())
	require.NotContains(t, out.String(), "conveyor running", "the banner was printed")
	require.Contains(t, out.String(), "api exited (status 3) before it was ready")
	for _, name := range []string{"relay", "worker"} {
		_, err := os.Stat(filepath.Join(dir, name))
		require.ErrorIs(t, err, os.ErrNotExist, "the %s was started", name)
	}
}

// Ctrl-C reaches the whole process group, the log prefixers (sed) too: one
// that died of it left its service writing its shutdown to a closed pipe,
// and a Go binary dies of SIGPIPE there, before a worker has handed its
// running tasks back and with its last lines lost.
func TestRunAllKeepsTheLogsWhileTheServicesStop(t *testing.T) {
	t.Parallel()
	script, err := filepath.Abs("run-all.sh")
	require.NoError(t, err)
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	require.NoError(t, os.Mkdir(bin, 0o755))
	// A stand-in for the relay that logs as it stops (run-all.sh's SIGTERM;
	// the SIGINT is ignored in a background process of a script).
	relay := `trap 'sleep 0.3; echo stopped cleanly; touch "$MARKS/stopped"; exit 0' TERM
echo started
while :; do sleep 0.1; done
`
	require.NoError(t, os.WriteFile(filepath.Join(bin, "relay"), []byte("#!/usr/bin/env bash\n"+relay), 0o755))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", script, filepath.Join(bin, "relay"))
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "MARKS="+dir)
	// Its own process group, as a terminal's foreground job is.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Whatever happens, no stand-in outlives the test.
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	defer func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }()
	logPath := filepath.Join(dir, "out.log")
	logFile, err := os.Create(logPath)
	require.NoError(t, err)
	defer func() { _ = logFile.Close() }()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	require.NoError(t, cmd.Start())
	out := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	require.Eventually(t, func() bool { return strings.Contains(out(), "[relay] started") }, 30*time.Second, 50*time.Millisecond)
	require.NoError(t, syscall.Kill(-cmd.Process.Pid, syscall.SIGINT))
	_ = cmd.Wait()
	require.NoError(t, ctx.Err(), "run-all.sh did not stop:\n%s", out())
	require.Contains(t, out(), "[relay] stopped cleanly", "the relay's last lines were lost")
	_, err = os.Stat(filepath.Join(dir, "stopped"))
	require.NoError(t, err, "the relay died before it had stopped:\n%s", out())
}

// Another process on API_ADDR (a second `make run`, one left over) answers
// /readyz itself: run-all.sh took that for its own API, started the relay
// and the worker and said the pipeline ran, while its API failed to listen.
func TestRunAllRefusesAnAPIAddressAlreadyInUse(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("run-all.sh needs curl")
	}
	script, err := filepath.Abs("run-all.sh")
	require.NoError(t, err)
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
	}))
	defer other.Close()
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	require.NoError(t, os.Mkdir(bin, 0o755))
	// The API connects to the database before it listens, and then finds
	// its port taken.
	fake := map[string]string{
		"api": `case "$1" in
  migrate) exit 0 ;;
  bootstrap) echo cvk_fake_key; exit 0 ;;
esac
sleep 1
echo 'conveyor-api: listen on API_ADDR: bind: address already in use' >&2
exit 3
`,
		"relay":  "touch \"$MARKS/relay\"\nexec sleep 60\n",
		"worker": "touch \"$MARKS/worker\"\nexec sleep 60\n",
	}
	for name, body := range fake {
		require.NoError(t, os.WriteFile(filepath.Join(bin, name), []byte("#!/usr/bin/env bash\n"+body), 0o755))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", script, filepath.Join(bin, "api"), filepath.Join(bin, "relay"), filepath.Join(bin, "worker"))
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "API_ADDR="+other.Listener.Addr().String(), "MARKS="+dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	require.NoError(t, ctx.Err(), "run-all.sh did not stop:\n%s", out.String())
	_, ok := errors.AsType[*exec.ExitError](err)
	require.True(t, ok, "run-all.sh exited 0:\n%s", out.String())
	require.NotContains(t, out.String(), "conveyor running", "the banner was printed")
	require.Contains(t, out.String(), "already in use")
	for _, name := range []string{"relay", "worker"} {
		_, err := os.Stat(filepath.Join(dir, name))
		require.ErrorIs(t, err, os.ErrNotExist, "the %s was started:\n%s", name, out.String())
	}
}
