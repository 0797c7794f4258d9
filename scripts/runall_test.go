// Package scripts holds the tests of the repository's shell scripts.
package scripts

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
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
