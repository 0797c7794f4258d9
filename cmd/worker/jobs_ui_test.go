package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// getJSON reads path from the API into v and requires a 200.
func (b *bundle) getJSON(t *testing.T, path string, v any) {
	t.Helper()
	resp, err := b.client.Get(b.api + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%.500s", body)
	require.NoError(t, json.Unmarshal(body, v))
}

// The jobs page lists the org's jobs with their schedule, state, next tick
// and limits; a writer pauses, resumes and triggers a job from it, and the
// API then says the same; a refusal shows once beside the buttons; a
// reader sees the list and no button.
func TestDashboardJobsPage(t *testing.T) {
	b := setup(t)
	b.apply(t, `
jobs:
  - name: nightly
    type: demo.noop
    source: {kind: cron, schedule: "0 2 * * *", timezone: Europe/Paris}
    max_concurrency: 2
    max_concurrency_per_key: 1
  - {name: manual, type: demo.noop}
`)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)

	var row string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/jobs"),
		chromedp.WaitVisible(`tr[data-job="nightly"]`, chromedp.ByQuery),
		chromedp.Text(`tr[data-job="nightly"]`, &row, chromedp.ByQuery))
	for _, want := range []string{"demo.noop", "0 2 * * *", "Europe/Paris", "active", "2 at once", "1 per key"} {
		require.Contains(t, row, want)
	}
	var nav string
	run(t, tab, 5*time.Second, chromedp.Text(`a[aria-current="page"]`, &nav, chromedp.ByQuery))
	require.Equal(t, "Jobs", nav)

	type jobView struct {
		Name       string     `json:"name"`
		Paused     bool       `json:"paused"`
		NextTickAt *time.Time `json:"next_tick_at"`
	}
	job := func(name string) jobView {
		var j jobView
		b.getJSON(t, "/v1/jobs/"+name, &j)
		return j
	}
	require.NotNil(t, job("nightly").NextTickAt)
	var tick bool
	run(t, tab, 5*time.Second, chromedp.Evaluate(`document.querySelector('tr[data-job="nightly"] time') !== null`, &tick))
	require.True(t, tick, "the next tick shows")

	// Pause: the API says paused, the row says so and offers Resume.
	run(t, tab, 30*time.Second,
		chromedp.Click(`#pause-nightly`, chromedp.ByQuery),
		chromedp.WaitVisible(`#resume-nightly`, chromedp.ByQuery),
		chromedp.Text(`tr[data-job="nightly"] [data-paused]`, &row, chromedp.ByQuery))
	require.Contains(t, row, "paused")
	require.True(t, job("nightly").Paused)

	// Resume.
	run(t, tab, 30*time.Second,
		chromedp.Click(`#resume-nightly`, chromedp.ByQuery),
		chromedp.WaitVisible(`#pause-nightly`, chromedp.ByQuery))
	require.False(t, job("nightly").Paused)
	require.NotNil(t, job("nightly").NextTickAt)

	// Trigger: a task of the job, linked from the row.
	var href string
	var ok bool
	run(t, tab, 30*time.Second,
		chromedp.Click(`#trigger-manual`, chromedp.ByQuery),
		chromedp.WaitVisible(`tr[data-job="manual"] a[href^="/ui/tasks/"]`, chromedp.ByQuery),
		chromedp.AttributeValue(`tr[data-job="manual"] a[href^="/ui/tasks/"]`, "href", &href, &ok, chromedp.ByQuery))
	id := strings.TrimPrefix(href, "/ui/tasks/")
	var created struct {
		ID    string `json:"id"`
		Type  string `json:"type"`
		JobID string `json:"job_id"`
	}
	b.getJSON(t, "/v1/tasks/"+id, &created)
	require.Equal(t, "demo.noop", created.Type)
	require.NotEmpty(t, created.JobID, "the task is the job's")

	// A refusal shows once, beside that job's buttons, however often the
	// button is pressed.
	var shown []string
	run(t, tab, 30*time.Second,
		chromedp.Evaluate(`{
			const real = window.fetch;
			window.fetch = (url, opts) => String(url).endsWith("/trigger")
				? Promise.resolve(new Response(JSON.stringify({title: "Too Many Requests", detail: "slow down"}),
					{status: 429, headers: {"Content-Type": "application/problem+json"}}))
				: real(url, opts);
		}`, nil),
		chromedp.Click(`#trigger-nightly`, chromedp.ByQuery),
		chromedp.WaitVisible(`tr[data-job="nightly"] .error[role="alert"]`, chromedp.ByQuery),
		chromedp.Click(`#trigger-nightly`, chromedp.ByQuery),
		chromedp.Sleep(500*time.Millisecond),
		chromedp.Evaluate(`[...document.querySelectorAll('main .error[role="alert"]')].map((e) => e.textContent)`, &shown))
	require.Equal(t, []string{"slow down"}, shown)

	// A reader sees the jobs and no button.
	var reader struct {
		Secret string `json:"secret"`
	}
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/keys", map[string]any{"name": "looker", "role": "reader"},
		http.StatusCreated), &reader))
	looker := browser(t)
	run(t, looker, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/login"),
		chromedp.WaitVisible("#key", chromedp.ByID),
		chromedp.SendKeys("#key", reader.Secret, chromedp.ByID),
		chromedp.Click(`button[type="submit"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#signout", chromedp.ByID),
		chromedp.Navigate(b.api+"/ui/jobs"),
		chromedp.WaitVisible(`tr[data-job="nightly"]`, chromedp.ByQuery))
	var buttons int
	run(t, looker, 5*time.Second, chromedp.Evaluate(`document.querySelectorAll("main button").length`, &buttons))
	require.Zero(t, buttons, "a reader has no button")
}

// A running task whose cancel was asked goes on until its handler stops:
// its page says the cancel was requested, and offers no Cancel button to
// ask again, also when opened afresh.
func TestDashboardTaskPageSaysCancelRequested(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	// Running on a worker that never hears of the cancel.
	id := b.submit(t, "dash.deaf", map[string]any{}, 1)
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1,
		worker_id = 'deaf', started_at = now(), lease_expires_at = now() + interval '1 hour',
		version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	var cancels int
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible(`#status [data-status="IN_PROGRESS"]`, chromedp.ByQuery),
		chromedp.Click("#cancel", chromedp.ByID),
		chromedp.WaitVisible("#cancel-requested", chromedp.ByID),
		chromedp.Evaluate(`document.querySelectorAll("#cancel").length`, &cancels))
	require.Zero(t, cancels, "no Cancel button once the cancel was requested")
	var task struct {
		Status            string     `json:"status"`
		CancelRequestedAt *time.Time `json:"cancel_requested_at"`
	}
	b.getJSON(t, "/v1/tasks/"+id.String(), &task)
	require.Equal(t, "IN_PROGRESS", task.Status)
	require.NotNil(t, task.CancelRequestedAt)
	run(t, tab, 30*time.Second,
		chromedp.Reload(),
		chromedp.WaitVisible("#cancel-requested", chromedp.ByID),
		chromedp.Evaluate(`document.querySelectorAll("#cancel").length`, &cancels))
	require.Zero(t, cancels)
}

// A cancel asked elsewhere (here the API, as the CLI does) while a running
// task's page is open reaches the page through the task's stream: the
// Cancel button goes, and the page says the cancel was requested. The
// page's times name their zone. A pending task whose cancel was asked
// (its worker handed it back since) is cancelled at once by asking again:
// its page offers the Cancel button, and does not speak of a handler.
func TestDashboardTaskPageHearsACancelAskedElsewhere(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "dash.deaf", map[string]any{}, 1)
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET status = 'IN_PROGRESS', attempt = 1,
		worker_id = 'deaf', started_at = now(), lease_expires_at = now() + interval '1 hour',
		version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible(`#status [data-status="IN_PROGRESS"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#cancel", chromedp.ByID))
	var zoned bool
	run(t, tab, 5*time.Second, chromedp.Evaluate(`[...document.querySelectorAll("main time")].every((el) =>
		el.textContent.includes(new Intl.DateTimeFormat(undefined, { timeZoneName: "short" })
			.formatToParts(new Date(el.dateTime)).find((p) => p.type === "timeZoneName").value))
		&& document.querySelectorAll("main time").length > 0`, &zoned))
	require.True(t, zoned, "every time shown names its zone")
	// The history replayed (a PENDING event: the task was moved to
	// IN_PROGRESS without one) makes the page read the task again, 200 ms
	// on; the cancel comes after that read.
	run(t, tab, 5*time.Second, chromedp.WaitVisible("#timeline li", chromedp.ByQuery), chromedp.Sleep(time.Second))

	require.Equal(t, http.StatusAccepted, b.cancel(t, id), "asked of a running task")
	var cancels int
	var said string
	run(t, tab, 30*time.Second,
		chromedp.WaitVisible("#cancel-requested", chromedp.ByID),
		chromedp.Text("#cancel-requested", &said, chromedp.ByID),
		chromedp.Evaluate(`document.querySelectorAll("#cancel").length`, &cancels))
	require.Zero(t, cancels, "no Cancel button once the cancel was requested")
	require.Contains(t, said, "the handler is told to stop")

	// Handed back by its worker, the task waits again with its cancel asked.
	_, err = b.pool.Exec(context.Background(), `UPDATE tasks SET status = 'PENDING', worker_id = NULL,
		lease_expires_at = NULL, next_run_at = now() + interval '1 hour', version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	// The history replayed (its "Cancel requested" event is of a running
	// task) may show the note for a moment, until the page reads the task
	// again: what counts is where the page settles.
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible(`#status [data-status="PENDING"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#cancel", chromedp.ByID))
	var settled bool
	run(t, tab, 10*time.Second, chromedp.Poll(`document.querySelector('#status [data-status="PENDING"]') !== null
		&& document.querySelector("#cancel") !== null && document.querySelector("#cancel-requested") === null`,
		&settled, chromedp.WithPollingInterval(50*time.Millisecond)))
	require.True(t, settled, "a pending task has no handler to stop")
}

// The overview's outbox line counts the messages parked for want of a
// worker of their type, not only those due.
func TestDashboardOverviewShowsParkedMessages(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	b.submit(t, "dash.nobody", map[string]any{}, 1)
	// The relay parks the message: no worker of the type has started.
	testenv.Eventually(t, 30*time.Second, func() error {
		var parked int
		if err := b.pool.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox WHERE available_at = 'infinity'`).Scan(&parked); err != nil {
			return err
		}
		if parked != 1 {
			return fmt.Errorf("%d parked", parked)
		}
		return nil
	})
	tab := browser(t)
	signIn(t, tab, b.api, key)
	var line string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/"),
		chromedp.WaitVisible("#outbox-line", chromedp.ByID),
		chromedp.Text("#outbox-line", &line, chromedp.ByID))
	require.Contains(t, line, "1 parked")
}
