package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const e2eJobsFile = `jobs:
  - name: cli-report
    type: cli.report
    source:
      kind: cron
      schedule: "0 3 * * *"
      timezone: Europe/Paris
    max_concurrency: 2
  - name: cli-sleep
    type: demo.sleep
    payload: {steps: 1, step_ms: 10}
types:
  - type: cli.report
    max_concurrency: 4
    max_concurrency_per_key: 1
`

// apply, jobs and types against the real API: a file applied, applied
// again, a dry run that changes nothing, pauses, a trigger followed to
// its end.
func TestJobsAgainstThePipeline(t *testing.T) {
	p := startPipeline(t)
	file := filepath.Join(t.TempDir(), "jobs.yaml")
	write := func(content string) {
		t.Helper()
		require.NoError(t, os.WriteFile(file, []byte(content), 0o600))
	}

	// A bad file is refused here, before the API.
	write(strings.Replace(e2eJobsFile, `"0 3 * * *"`, `"0 3 * *"`, 1))
	r := p.run(t, "apply", "-f", file)
	require.Equal(t, 1, r.code)
	require.Regexp(t, `^`+file+`:6:17: jobs\[0\]\.source\.schedule: .+\nconveyor: `+file+` has 1 mistake; nothing was sent\n$`, r.stderr)

	// Created, then unchanged.
	write(e2eJobsFile)
	require.Equal(t, `+ job cli-report (cli.report, cron "0 3 * * *" Europe/Paris)
+ job cli-sleep (demo.sleep)
+ type cli.report (max_concurrency 4, max_concurrency_per_key 1)
3 created
`, p.ok(t, "apply", "-f", file))
	require.Equal(t, "= job cli-report\n= job cli-sleep\n= type cli.report\n3 unchanged\n", p.ok(t, "apply", "-f", file))

	// A dry run of a change lists it and leaves the org as it was.
	write(strings.Replace(e2eJobsFile, "    max_concurrency: 2\n", "    max_concurrency: 3\n    priority: 7\n", 1))
	require.Equal(t, `~ job cli-report: priority 5 → 7, max_concurrency 2 → 3
= job cli-sleep
= type cli.report
(dry run) would update 1; 2 unchanged
`, p.ok(t, "apply", "-f", file, "--dry-run"))
	var got struct {
		Priority       int `json:"priority"`
		MaxConcurrency int `json:"max_concurrency"`
	}
	require.NoError(t, json.Unmarshal([]byte(p.ok(t, "jobs", "get", "cli-report", "-o", "json")), &got))
	require.Equal(t, 5, got.Priority, "a dry run changes nothing")
	require.Equal(t, 2, got.MaxConcurrency)

	// The table.
	out := p.ok(t, "jobs")
	require.Regexp(t, `^NAME\s+TYPE\s+SCHEDULE\s+NEXT\s+LIMIT\n`, out)
	require.Regexp(t, `(?m)^cli-report\s+cli\.report\s+0 3 \* \* \* Europe/Paris\s+in \d+[smhd]\s+2$`, out)
	require.Regexp(t, `(?m)^cli-sleep\s+demo\.sleep\s+-\s+-\s+-$`, out)

	// Paused, then resumed.
	require.Equal(t, "job cli-report paused\n", p.ok(t, "jobs", "pause", "cli-report"))
	require.Regexp(t, `(?m)^cli-report\s+cli\.report\s+0 3 \* \* \* Europe/Paris\s+paused\s+2$`, p.ok(t, "jobs"))
	require.Regexp(t, `(?m)^state:\s+paused since \S+$`, p.ok(t, "jobs", "get", "cli-report"))
	require.Regexp(t, `^job cli-report resumed \(next tick in \d+[smhd]\)\n$`, p.ok(t, "jobs", "resume", "cli-report"))
	require.Regexp(t, `(?m)^cli-report\s+cli\.report\s+0 3 \* \* \* Europe/Paris\s+in \d+[smhd]\s+2$`, p.ok(t, "jobs"))

	// A type paused shows in types, with the file's limits.
	require.Equal(t, "type cli.other paused\n", p.ok(t, "types", "pause", "cli.other"))
	out = p.ok(t, "types")
	require.Regexp(t, `^TYPE\s+LIMIT\s+PER-KEY\s+PAUSED\n`, out)
	require.Regexp(t, `(?m)^cli\.report\s+4\s+1\s+no$`, out)
	require.Regexp(t, `(?m)^cli\.other\s+-\s+-\s+yes, \d+s ago$`, out)
	require.Equal(t, "type cli.other resumed\n", p.ok(t, "types", "resume", "cli.other"))
	require.NotRegexp(t, `(?m)^cli\.other\s+.*yes`, p.ok(t, "types"))

	// A trigger, followed to its end; the task knows its job and key.
	r = p.run(t, "jobs", "trigger", "cli-sleep", "--concurrency-key", "acct-1", "--wait")
	require.Equal(t, 0, r.code, r.stderr)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	id := lines[0]
	require.Len(t, id, 36)
	require.Regexp(t, `COMPLETED\s+100%\s+Completed$`, lines[len(lines)-1])
	out = p.ok(t, "get", id)
	require.Regexp(t, `(?m)^job:\s+[0-9a-f-]{36}$`, out)
	require.Regexp(t, `(?m)^concurrency key:\s+acct-1$`, out)

	// submit's new flags reach the task.
	id = p.submit(t, "cli.report", "--concurrency-key", "acct-2", "--task-timeout", "10m", "--heartbeat-timeout", "30s")
	out = p.ok(t, "get", id)
	require.Regexp(t, `(?m)^concurrency key:\s+acct-2$`, out)
	require.Regexp(t, `(?m)^timeout:\s+10m0s$`, out)
	require.Regexp(t, `(?m)^heartbeat timeout:\s+30s$`, out)
}
