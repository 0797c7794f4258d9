package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// These tests run the conveyor binary against the real pipeline: the api,
// relay and worker binaries on a database and a vhost of the test's own,
// on the machine's PostgreSQL and RabbitMQ.

// pipeline is a running api, relay and worker, and the admin key of the
// org "test".
type pipeline struct {
	url   string
	token string
	// bin is the conveyor binary.
	bin string
	// home is the HOME and XDG_CONFIG_HOME of the runs: no config file of
	// the machine's user reaches them.
	home string
}

func startPipeline(t *testing.T) *pipeline {
	t.Helper()
	if testing.Short() {
		t.Skip("runs the api, relay and worker binaries")
	}
	t.Parallel()
	db := testdb.New(t)
	amqpURL := testenv.NewVhost(t)
	apiAddr := testenv.FreeAddr(t)
	p := &pipeline{url: "http://" + apiAddr, bin: testenv.Binary(t, "./cmd/conveyor"), home: t.TempDir()}
	logs := []string{"LOG_FORMAT=text", "LOG_LEVEL=warn"}
	testenv.Start(t, "api", testenv.Binary(t, "./cmd/api"), append(logs,
		"DATABASE_URL="+db.URL, "API_ADDR="+apiAddr)...)
	testenv.Start(t, "relay", testenv.Binary(t, "./cmd/relay"), append(logs,
		"DATABASE_URL="+db.URL, "AMQP_URL="+amqpURL, "RELAY_ADMIN_ADDR="+testenv.FreeAddr(t),
		"RELAY_POLL_INTERVAL=100ms", "RELAY_RECONNECT_BACKOFF_MAX=300ms")...)
	testenv.Start(t, "worker", testenv.Binary(t, "./cmd/worker"), append(logs,
		"DATABASE_URL="+db.URL, "AMQP_URL="+amqpURL, "WORKER_ADMIN_ADDR="+testenv.FreeAddr(t),
		"WORKER_ID=cli-worker", "WORKER_CONCURRENCY=4", "PROGRESS_MIN_INTERVAL=50ms",
		"RETRY_BACKOFF_BASE=200ms", "RETRY_BACKOFF_MAX=1s", "MAINTENANCE_INTERVAL=300ms",
		"SHUTDOWN_TIMEOUT=5s", "WORKER_RECONNECT_BACKOFF_MAX=300ms")...)
	testenv.WaitHTTP(t, p.url+"/readyz", 60*time.Second)
	var err error
	p.token, err = postgres.NewDirectory(db.Pool).Bootstrap(context.Background(), testdb.TestOrg, "cli-tests")
	require.NoError(t, err)
	return p
}

// env is the environment of a run of the binary: the machine's, but for
// the configuration, which is the pipeline's.
func (p *pipeline) env(extra ...string) []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CONVEYOR_") && !strings.HasPrefix(kv, "HOME=") && !strings.HasPrefix(kv, "XDG_CONFIG_HOME=") {
			out = append(out, kv)
		}
	}
	return append(append(out, "CONVEYOR_URL="+p.url, "CONVEYOR_TOKEN="+p.token, "HOME="+p.home,
		"XDG_CONFIG_HOME="+p.home), extra...)
}

// exec runs the binary to its end (within a minute) and logs nothing:
// the checks that poll call it, so that a failing test's log ends with the
// failure, not with hundreds of polls.
func (p *pipeline) exec(args ...string) (result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, p.bin, args...)
	cmd.Env = p.env()
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	if exit, ok := errors.AsType[*exec.ExitError](err); ok {
		r.code, err = exit.ExitCode(), nil
	}
	return r, err
}

// run runs the binary to its end and logs what it printed.
func (p *pipeline) run(t *testing.T, args ...string) result {
	t.Helper()
	r, err := p.exec(args...)
	require.NoError(t, err, "conveyor %v", args)
	t.Logf("conveyor %s → %d\n%s%s", strings.Join(args, " "), r.code, head(r.stdout, 30), r.stderr)
	return r
}

// head is the first n lines of s, and how many more there were: a failing
// test's log is read in CI's excerpt, which a JSON document of hundreds of
// lines would fill before the failure.
func head(s string, n int) string {
	lines := strings.SplitAfter(s, "\n")
	if len(lines) <= n+1 {
		return s
	}
	return strings.Join(lines[:n], "") + fmt.Sprintf("… %d more lines\n", strings.Count(s, "\n")-n)
}

// ok runs the binary and wants exit 0.
func (p *pipeline) ok(t *testing.T, args ...string) string {
	t.Helper()
	r := p.run(t, args...)
	require.Equal(t, 0, r.code, "conveyor %v: %s", args, r.stderr)
	return r.stdout
}

// poll runs the binary for a check that polls: unlogged, and a failed run
// is the check's error, to be tried again, not the test's end.
func (p *pipeline) poll(args ...string) (string, error) {
	r, err := p.exec(args...)
	switch {
	case err != nil:
		return "", err
	case r.code != 0:
		return "", fmt.Errorf("conveyor %v → %d: %s", args, r.code, r.stderr)
	}
	return r.stdout, nil
}

type taskDoc struct {
	ID          string          `json:"id"`
	Type        string          `json:"type"`
	Status      string          `json:"status"`
	Progress    int             `json:"progress"`
	State       string          `json:"state"`
	Error       string          `json:"error"`
	Attempt     int             `json:"attempt"`
	MaxAttempts int             `json:"max_attempts"`
	Result      json.RawMessage `json:"result"`
}

func (p *pipeline) task(t *testing.T, id string) taskDoc {
	t.Helper()
	var d taskDoc
	require.NoError(t, json.Unmarshal([]byte(p.ok(t, "get", id, "-o", "json")), &d))
	return d
}

// pollTask reads a task for a check that polls (see poll).
func (p *pipeline) pollTask(id string) (taskDoc, error) {
	var d taskDoc
	out, err := p.poll("get", id, "-o", "json")
	if err == nil {
		err = json.Unmarshal([]byte(out), &d)
	}
	return d, err
}

func (p *pipeline) waitStatus(t *testing.T, id, status string) taskDoc {
	t.Helper()
	var d taskDoc
	testenv.Eventually(t, 30*time.Second, func() error {
		var err error
		switch d, err = p.pollTask(id); {
		case err != nil:
			return err
		case d.Status != status:
			return fmt.Errorf("task %s is %s (%d%%, %s), want %s", id, d.Status, d.Progress, d.State, status)
		}
		return nil
	})
	t.Logf("task %s is %s", id, status)
	return d
}

// submit submits a task through the binary and returns its id.
func (p *pipeline) submit(t *testing.T, args ...string) string {
	t.Helper()
	id := strings.TrimSpace(p.ok(t, append([]string{"submit"}, args...)...))
	require.Len(t, id, 36, "a task id")
	return id
}

// The task commands and the key commands against the real API.
func TestCommandsAgainstThePipeline(t *testing.T) {
	p := startPipeline(t)

	id := p.submit(t, "demo.sleep", "--payload", `{"steps":5,"step_ms":200}`)
	out := p.ok(t, "get", id)
	require.Regexp(t, `(?m)^id:\s+`+id+`$`, out)
	require.Regexp(t, `(?m)^type:\s+demo.sleep$`, out)
	require.Regexp(t, `(?m)^payload:\s+\{("steps":5,"step_ms":200|"step_ms":200,"steps":5)\}$`, out)
	done := p.waitStatus(t, id, "COMPLETED")
	require.Equal(t, 100, done.Progress)
	require.Contains(t, string(done.Result), "slept_ms")

	// The same input is the same task, and says so.
	r := p.run(t, "submit", "demo.sleep", "--payload", `{"step_ms":200,"steps":5}`)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, id+"\n", r.stdout)
	require.Contains(t, r.stderr, "the same input as task "+id+" (COMPLETED)")

	// The history, oldest first.
	out = p.ok(t, "events", id)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Regexp(t, `^ID\s+TIME\s+STATUS\s+PROGRESS\s+ACTOR\s+BY\s+STATE\s+ERROR$`, lines[0])
	require.Regexp(t, `PENDING\s+0%\s+API\s+key cli-tests\s+Queued$`, lines[1])
	require.Regexp(t, `COMPLETED\s+100%\s+WORKER\s+`, lines[len(lines)-1])
	require.Len(t, lines, 1+1+1+5+1, "queued, running, 5 steps, completed: %s", out)

	// Page by page, the way the command says: the page before, then the
	// rest; --all reads the whole history at once.
	r = p.run(t, "events", id, "--limit", "3")
	require.Equal(t, 0, r.code, r.stderr)
	ids := func(table string) []string {
		var out []string
		for _, l := range strings.Split(strings.TrimSpace(table), "\n")[1:] {
			out = append(out, strings.Fields(l)[0])
		}
		return out
	}
	require.Equal(t, ids(out)[len(lines)-4:], ids(r.stdout), "the newest three")
	more := regexp.MustCompile(`(?m)^more: \S+ events (\S+) --limit 3 --cursor (\S+)$`).FindStringSubmatch(r.stderr)
	require.NotNil(t, more, r.stderr)
	require.Equal(t, id, more[1])
	older := p.ok(t, "events", id, "--limit", "3", "--cursor", more[2])
	require.Equal(t, ids(out)[len(lines)-7:len(lines)-4], ids(older), "the three before")
	r = p.run(t, "events", id, "--limit", "3", "--all")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, out, r.stdout, "--all: the whole history, oldest first")
	require.NotContains(t, r.stderr, "more:")
	var all struct{ Events []struct{ ID int64 } }
	require.NoError(t, json.Unmarshal([]byte(p.ok(t, "events", id, "-n", "2", "--all", "-o", "json")), &all))
	require.Len(t, all.Events, len(lines)-1)
	require.True(t, slices.IsSortedFunc(all.Events, func(a, b struct{ ID int64 }) int { return int(b.ID - a.ID) }),
		"as the API answers: newest first")

	// A long task, cancelled while it runs, then retried.
	long := p.submit(t, "demo.sleep", "-p", `{"steps":100,"step_ms":100}`, "--priority", "9", "--max-attempts", "2")
	testenv.Eventually(t, 30*time.Second, func() error {
		switch d, err := p.pollTask(long); {
		case err != nil:
			return err
		case d.Progress == 0:
			return fmt.Errorf("task %s not started: %s", long, d.Status)
		}
		return nil
	})
	require.Regexp(t, `^`+long+` cancel requested \(IN_PROGRESS, \d+%\)\n$`, p.ok(t, "cancel", long))
	p.waitStatus(t, long, "CANCELLED")
	require.Equal(t, long+" PENDING (attempt 0 of 2)\n", p.ok(t, "retry", long))
	// Cancelled again: at once if still PENDING, else by request.
	require.Regexp(t, `^`+long+` (CANCELLED|cancel requested \(IN_PROGRESS, \d+%\))\n$`, p.ok(t, "cancel", long))
	p.waitStatus(t, long, "CANCELLED")

	// Listings, filtered, as a table and as JSON.
	out = p.ok(t, "ls", "--type", "demo.sleep")
	require.Regexp(t, `^ID\s+TYPE\s+STATUS\s+PROGRESS\s+STATE\s+AGE\s+UPDATED\n`, out)
	require.Regexp(t, long+`\s+demo.sleep\s+CANCELLED\s+`, out)
	require.Regexp(t, id+`\s+demo.sleep\s+COMPLETED\s+100%\s+Completed`, out)
	require.Less(t, strings.Index(out, long), strings.Index(out, id), "newest first")
	var page struct {
		Tasks      []taskDoc `json:"tasks"`
		NextCursor string    `json:"next_cursor"`
	}
	require.NoError(t, json.Unmarshal([]byte(p.ok(t, "ls", "--status", "completed", "-o", "json")), &page))
	require.Len(t, page.Tasks, 1)
	require.Equal(t, id, page.Tasks[0].ID)
	r = p.run(t, "ls", "--limit", "1")
	require.Equal(t, 0, r.code)
	require.Contains(t, r.stdout, long)
	require.Contains(t, r.stderr, "more: conveyor ls --limit 1 --cursor ")
	require.Len(t, strings.Split(strings.TrimSpace(p.ok(t, "ls", "--limit", "1", "--all")), "\n"), 3, "header and both tasks")

	// The API's refusals: exit 1 and its detail.
	r = p.run(t, "get", "0193a2b4-0000-7000-8000-000000000000")
	require.Equal(t, 1, r.code)
	require.Regexp(t, `^conveyor: .+ \(HTTP 404\)\n$`, r.stderr)
	r = p.run(t, "retry", id)
	require.Equal(t, 1, r.code)
	require.Regexp(t, `^conveyor: .+ \(HTTP 409\)\n$`, r.stderr)
	r = p.run(t, "submit", "demo.sleep", "--priority", "12")
	require.Equal(t, 1, r.code)
	require.Regexp(t, `^conveyor: priority: .+ \(HTTP 422\)\n$`, r.stderr)

	// Keys: make one, use it, list it, revoke it, and it is refused.
	r = p.run(t, "keys", "create", "billing", "--role", "writer")
	require.Equal(t, 0, r.code, r.stderr)
	secret := strings.TrimSpace(r.stdout)
	require.Regexp(t, `^cvk_[a-z2-7]{16}_[a-z2-7]{52}$`, secret)
	require.Regexp(t, `^made key [0-9a-f-]{36} \(cvk_[a-z2-7]{16}, role writer\)`, r.stderr)
	keyID := strings.Fields(r.stderr)[2]

	out = p.ok(t, "whoami", "--token", secret)
	require.Regexp(t, `(?m)^name:\s+billing$`, out)
	require.Regexp(t, `(?m)^role:\s+writer$`, out)
	r = p.run(t, "keys", "ls", "--token", secret)
	require.Equal(t, 1, r.code, "a writer is no admin")
	require.Contains(t, r.stderr, "(HTTP 403)")

	// The API writes when a key was last used once a second: wait for it.
	testenv.Eventually(t, 10*time.Second, func() error {
		var err error
		if out, err = p.poll("keys", "ls"); err != nil {
			return err
		}
		if !regexp.MustCompile(`(?m)^` + keyID + `\s+billing\s+writer\s+cvk_[a-z2-7]{16}\s+\S+\s+\S+\s+active$`).MatchString(out) {
			return fmt.Errorf("the key, used, not listed as such:\n%s", out)
		}
		return nil
	})
	require.Regexp(t, `(?m)^[0-9a-f-]{36}\s+cli-tests\s+admin\s+`, out)

	require.Regexp(t, `^revoked key `+keyID+` \(billing, cvk_[a-z2-7]{16}\)\n$`, p.ok(t, "keys", "revoke", keyID))
	require.Regexp(t, `(?m)^`+keyID+`\s+billing\s+.*revoked \S+$`, p.ok(t, "keys", "ls"))
	testenv.Eventually(t, 10*time.Second, func() error {
		r, err := p.exec("whoami", "--token", secret)
		if err != nil {
			return err
		}
		if r.code != 1 || !strings.Contains(r.stderr, "(HTTP 401)") {
			return fmt.Errorf("the revoked key still works: %d %s", r.code, r.stderr)
		}
		return nil
	})
}

// The streaming commands: submit --wait, watch off a terminal, and the
// org's live events.
func TestStreamingCommandsAgainstThePipeline(t *testing.T) {
	p := startPipeline(t)

	// submit --wait follows the task to its end and exits 0: it COMPLETED.
	r := p.run(t, "submit", "demo.sleep", "--payload", `{"steps":5,"step_ms":200}`, "--wait")
	require.Equal(t, 0, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	id := lines[0]
	require.Len(t, id, 36)
	require.Regexp(t, `^\S+  `+id+`  PENDING       0%  Queued$`, lines[1])
	require.Regexp(t, `^\S+  `+id+`  IN_PROGRESS   0%  Running$`, lines[2])
	require.Regexp(t, `^\S+  `+id+`  IN_PROGRESS  40%  Step 2/5$`, lines[4])
	require.Regexp(t, `^\S+  `+id+`  COMPLETED   100%  Completed$`, lines[len(lines)-1])
	require.Len(t, lines, 1+1+1+5+1, "the id, then every event once: %s", r.stdout)

	// watch replays a finished task's whole history, and exits 0.
	require.Equal(t, strings.Join(lines[1:], "\n")+"\n", p.ok(t, "watch", id))

	// A task that fails its only attempt: exit 1, its error on the screen.
	failing := p.submit(t, "demo.sleep", "-p", `{"steps":2,"step_ms":50,"fail_times":1}`, "--max-attempts", "1")
	r = p.run(t, "watch", failing)
	require.Equal(t, 1, r.code, r.stderr)
	require.Regexp(t, `(?m)^\S+  `+failing+`  FAILED      \s*\d+%  Failed: .*demo.sleep: failing attempt 1 of the first 1, as asked$`, r.stdout)
	// events --follow of the same task ends the same way: exit 1.
	r = p.run(t, "events", "--follow", failing)
	require.Equal(t, 1, r.code, r.stderr)
	require.Contains(t, r.stdout, "FAILED")
	require.Equal(t, 0, p.run(t, "events", "--follow", id).code, "a COMPLETED task's follow exits 0")

	// Several at once, as JSON lines: every event of each, once.
	a := p.submit(t, "demo.sleep", "-p", `{"steps":3,"step_ms":100}`, "--no-dedupe")
	b := p.submit(t, "demo.sleep", "-p", `{"steps":3,"step_ms":100}`, "--no-dedupe")
	r = p.run(t, "watch", a, b, "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	seen := map[string][]int64{}
	for line := range strings.Lines(r.stdout) {
		var e struct {
			ID     int64           `json:"id"`
			TaskID string          `json:"task_id"`
			Status string          `json:"status"`
			Result json.RawMessage `json:"result"`
		}
		require.NoError(t, json.Unmarshal([]byte(line), &e), line)
		require.NotContains(t, seen[e.TaskID], e.ID, "event %d twice", e.ID)
		seen[e.TaskID] = append(seen[e.TaskID], e.ID)
		if e.Status == "COMPLETED" {
			require.Contains(t, string(e.Result), "slept_ms")
		}
	}
	require.Len(t, seen[a], 6, "queued, running, 3 steps, completed")
	require.Len(t, seen[b], 6)

	// The org's live events, filtered, until interrupted (exit 0).
	feed := exec.Command(p.bin, "events", "--follow", "--status", "COMPLETED")
	feed.Env = p.env()
	out := &testenv.SyncBuffer{}
	feed.Stdout, feed.Stderr = out, out
	require.NoError(t, feed.Start())
	exited := make(chan error, 1)
	go func() { exited <- feed.Wait() }()
	t.Cleanup(func() { _ = feed.Process.Kill() })
	// The feed starts now: submit until one of them shows (the first may
	// complete before the stream is open).
	var last string
	testenv.Eventually(t, 30*time.Second, func() error {
		if last != "" && strings.Contains(out.String(), last) {
			return nil
		}
		last = p.submit(t, "demo.sleep", "-p", `{"steps":1,"step_ms":10}`, "--no-dedupe")
		return fmt.Errorf("no COMPLETED event in the feed yet: %q", out.String())
	})
	require.NoError(t, feed.Process.Signal(syscall.SIGINT))
	select {
	case err := <-exited:
		require.NoError(t, err, "Ctrl-C ends the feed normally: %s", out.String())
	case <-time.After(10 * time.Second):
		t.Fatal("the feed did not stop on SIGINT")
	}
	for line := range strings.Lines(out.String()) {
		require.Regexp(t, `^\S+  [0-9a-f-]{36}  demo.sleep  COMPLETED   100%  Completed\n$`, line)
	}
}

// overview, the listing's new filters, and cancel --all and retry --all
// against the real API.
func TestOverviewAndBulkActionsAgainstThePipeline(t *testing.T) {
	p := startPipeline(t)

	// No worker runs these types: their tasks stay PENDING.
	var ids []string
	for i := range 3 {
		ids = append(ids, p.submit(t, "cli.bulk", "-p", fmt.Sprintf(`{"n":%d}`, i), "--metadata", `{"batch":"b1"}`))
	}
	other := p.submit(t, "cli.other", "--metadata", `{"batch":"b2"}`)
	slices.Sort(ids)
	listed := func(args ...string) []string {
		t.Helper()
		var page struct {
			Tasks []taskDoc `json:"tasks"`
		}
		require.NoError(t, json.Unmarshal([]byte(p.ok(t, append(append([]string{"ls"}, args...), "-o", "json")...)), &page))
		var got []string
		for _, d := range page.Tasks {
			got = append(got, d.ID)
		}
		slices.Sort(got)
		return got
	}

	// The listing's filters: metadata, an id, creation times.
	require.Equal(t, ids, listed("--q", "batch=b1", "--created-after", "10m"))
	require.Equal(t, []string{ids[1]}, listed("--q", ids[1]))
	require.Empty(t, listed("--created-before", "10m"))
	require.Equal(t, []string{other}, listed("--created-after", time.Now().Add(-time.Hour).UTC().Format(time.RFC3339), "--type", "cli.other"))

	// The overview: the five counts, the queues, the worker.
	var o struct {
		Counts map[string]int `json:"counts"`
		Types  []struct {
			Type    string `json:"type"`
			Pending int    `json:"pending"`
		} `json:"types"`
	}
	require.NoError(t, json.Unmarshal([]byte(p.ok(t, "overview", "-o", "json")), &o))
	require.Equal(t, map[string]int{"PENDING": 4, "IN_PROGRESS": 0, "COMPLETED": 0, "FAILED": 0, "CANCELLED": 0}, o.Counts)
	require.Len(t, o.Types, 2)
	require.Equal(t, "cli.bulk", o.Types[0].Type)
	require.Equal(t, 3, o.Types[0].Pending)
	testenv.Eventually(t, 30*time.Second, func() error {
		out, err := p.poll("overview")
		if err != nil {
			return err
		}
		for _, re := range []string{
			`(?m)^tasks:\s+PENDING 4  IN_PROGRESS 0  COMPLETED 0  FAILED 0  CANCELLED 0$`,
			`(?m)^last hour: 0 completed, 0 failed, 0.00 completed per minute$`,
			`(?m)^TYPE\s+WAITING\s+SCHEDULED\s+RUNNING\s+OLDEST$`,
			`(?m)^cli\.bulk\s+3\s+0\s+0\s+\d+[smh]$`,
			`(?m)^outbox: \d+ due.*, \d+ parked`,
			`(?m)^ID\s+HOST\s+TYPES\s+CONCURRENCY\s+HEARTBEAT\s+RUNNING$`,
			`(?m)^cli-worker \(leader\)\s+\S+\s+\S*demo\.sleep\S*\s+4\s+\d+s\s+0$`,
		} {
			if !regexp.MustCompile(re).MatchString(out) {
				return fmt.Errorf("no %s in\n%s", re, out)
			}
		}
		return nil
	})

	// cancel --all asks, and refuses when there is no terminal to ask on.
	r := p.run(t, "cancel", "--all", "--type", "cli.bulk")
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "standard input is not a terminal: give --yes")
	require.Equal(t, "3\n", p.ok(t, "cancel", "--all", "--type", "cli.bulk", "--dry-run"))
	require.Equal(t, ids, listed("--status", "PENDING", "--type", "cli.bulk"), "nothing changed yet")

	require.Equal(t, "cancelled 3, skipped 0\n", p.ok(t, "cancel", "--all", "--type", "cli.bulk", "--yes"))
	require.Equal(t, ids, listed("--status", "CANCELLED", "--type", "cli.bulk"))
	require.Equal(t, "PENDING", p.task(t, other).Status, "another type is left alone")
	require.Equal(t, "cancelled 0, skipped 0\n", p.ok(t, "cancel", "--all", "--type", "cli.bulk", "--yes"))

	// retry --all by metadata puts them back to PENDING.
	require.Equal(t, "3\n", p.ok(t, "retry", "--all", "--q", "batch=b1", "--dry-run"))
	require.Equal(t, "retried 3, skipped 0\n", p.ok(t, "retry", "--all", "--q", "batch=b1", "--yes"))
	require.Equal(t, ids, listed("--status", "PENDING", "--type", "cli.bulk"))

	// A status the action cannot change is the API's refusal.
	r = p.run(t, "cancel", "--all", "--status", "COMPLETED", "--yes")
	require.Equal(t, 1, r.code)
	require.Regexp(t, `^conveyor: .+ \(HTTP 422\)\n$`, r.stderr)
}
