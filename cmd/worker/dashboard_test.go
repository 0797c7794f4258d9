package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/fetch"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// The dashboard in a real browser (Debian's chromium, headless), against
// the whole pipeline: a person signs in with a key, submits a task from the
// form, watches its bar rise on the task's page without a reload, cancels
// it with the button, and sees it CANCELLED; a person of another org cannot
// open that page. The test takes the screenshots docs/ shows: set
// CONVEYOR_SCREENSHOTS to a directory (make screenshots) to keep them.

// browser starts a headless chromium of its own (its own cookies) and
// returns a context to drive a tab of it.
func browser(t *testing.T) context.Context {
	t.Helper()
	path, err := exec.LookPath("chromium")
	require.NoError(t, err, "the dashboard tests need Debian's chromium (apt-get install chromium); .ci/run installs it")
	// The profile is removed after the browser exits, which is after the
	// test's own temporary directories would be.
	profile, err := os.MkdirTemp("", "conveyor-chromium-")
	require.NoError(t, err)
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path),
		chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1280, 900),
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true),
		chromedp.UserDataDir(profile))
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
		_ = os.RemoveAll(profile)
	})
	// The first run starts the browser, for as long as ctx lives: it must
	// not carry a timeout.
	require.NoError(t, chromedp.Run(ctx))
	// Every confirm() is answered yes.
	chromedp.ListenTarget(ctx, func(ev any) {
		if _, ok := ev.(*page.EventJavascriptDialogOpening); ok {
			go func() { _ = chromedp.Run(ctx, page.HandleJavaScriptDialog(true)) }()
		}
	})
	return ctx
}

// dashboardKey is an admin key of the test org, to sign in with.
func (b *bundle) dashboardKey(t *testing.T) string {
	t.Helper()
	key, err := postgres.NewDirectory(b.pool).Bootstrap(context.Background(), testdb.TestOrg, "dashboard")
	require.NoError(t, err)
	return key
}

// run runs the actions with a deadline.
func run(t *testing.T, ctx context.Context, d time.Duration, actions ...chromedp.Action) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	require.NoError(t, chromedp.Run(ctx, actions...))
}

func signIn(t *testing.T, ctx context.Context, base, key string) {
	t.Helper()
	var who string
	run(t, ctx, 30*time.Second,
		chromedp.Navigate(base+"/ui/login"),
		chromedp.WaitVisible("#key", chromedp.ByID),
		chromedp.SendKeys("#key", key, chromedp.ByID),
		chromedp.Click(`button[type="submit"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#signout", chromedp.ByID),
		chromedp.Text("#who", &who, chromedp.ByID))
	require.Contains(t, who, "admin")
}

// screenshot saves the page as name.png in CONVEYOR_SCREENSHOTS, or in a
// temporary directory.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	var png []byte
	run(t, ctx, 20*time.Second, chromedp.FullScreenshot(&png, 100))
	require.Greater(t, len(png), 10_000, "a screenshot of %s", name)
	dir := os.Getenv("CONVEYOR_SCREENSHOTS")
	if dir == "" {
		dir = t.TempDir()
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
}

func TestDashboardInABrowser(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	ctx := context.Background()
	dir := postgres.NewDirectory(b.pool)
	key, err := dir.Bootstrap(ctx, testdb.TestOrg, "dashboard")
	require.NoError(t, err)
	other, err := dir.Bootstrap(ctx, "elsewhere", "dashboard")
	require.NoError(t, err)
	// Some history for the overview and the list.
	for i := range 6 {
		b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 10, "fail_times": i % 3}, 1)
	}

	tab := browser(t)
	signIn(t, tab, b.api, key)

	// Submit from the form; the page of the new task opens.
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(`tr[data-task]`, chromedp.ByQuery),
		chromedp.Click(`//summary[contains(., "Submit a task")]`, chromedp.BySearch),
		chromedp.SetValue("#s-type", "demo.sleep", chromedp.ByID),
		chromedp.SetValue("#s-payload", `{"steps": 40, "step_ms": 150}`, chromedp.ByID),
		chromedp.Click(`//button[normalize-space()="Submit"]`, chromedp.BySearch),
		chromedp.WaitVisible("#bar", chromedp.ByID))
	var url string
	run(t, tab, 5*time.Second, chromedp.Location(&url))
	require.Regexp(t, `/ui/tasks/[0-9a-f-]{36}$`, url)
	taskPage := url

	// The bar rises with no reload: a mark left on the page stays.
	run(t, tab, 5*time.Second, chromedp.Evaluate(`window.stayed = true`, nil))
	seen := map[int]bool{}
	deadline := time.Now().Add(30 * time.Second)
	for len(seen) < 3 && time.Now().Before(deadline) {
		var value int
		run(t, tab, 5*time.Second, chromedp.Evaluate(`document.getElementById("bar").value`, &value))
		if value > 0 && value < 100 {
			seen[value] = true
		}
		time.Sleep(100 * time.Millisecond)
	}
	require.GreaterOrEqual(t, len(seen), 3, "the bar took three values between 0 and 100: %v", seen)
	var stayed bool
	run(t, tab, 5*time.Second, chromedp.Evaluate(`window.stayed === true`, &stayed))
	require.True(t, stayed, "the page was not reloaded")
	var text string
	run(t, tab, 5*time.Second, chromedp.Text("main", &text, chromedp.ByQuery))
	require.NotContains(t, text, "null", "no missing value shows as null")
	require.NotContains(t, text, "undefined")
	screenshot(t, tab, "task")

	// Cancel with the button (the confirmation is accepted).
	var status string
	run(t, tab, 30*time.Second,
		chromedp.Click("#cancel", chromedp.ByID),
		chromedp.WaitVisible(`#status [data-status="CANCELLED"]`, chromedp.ByQuery),
		chromedp.Text("#status", &status, chromedp.ByID),
		chromedp.WaitVisible(`#retry`, chromedp.ByID))
	require.Equal(t, "CANCELLED", strings.TrimSpace(status))
	var timeline string
	run(t, tab, 10*time.Second,
		chromedp.WaitVisible(`//ol[@id="timeline"]/li[contains(., "CANCELLED")]`, chromedp.BySearch),
		chromedp.Text("#timeline", &timeline, chromedp.ByID))
	require.Contains(t, timeline, "Cancel requested")
	require.Contains(t, timeline, "dashboard (key)", "the timeline names who cancelled")

	// The list and the overview.
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(`tr[data-task] [data-status="CANCELLED"]`, chromedp.ByQuery))
	screenshot(t, tab, "tasks")

	// At a phone's width the page does not scroll sideways (wide tables
	// scroll in their own box), and the dark theme is one button away.
	var fits, dark bool
	run(t, tab, 10*time.Second,
		chromedp.EmulateViewport(390, 844),
		chromedp.Evaluate(`document.documentElement.scrollWidth <= window.innerWidth`, &fits),
		chromedp.Click("#theme", chromedp.ByID),
		chromedp.Evaluate(`getComputedStyle(document.body).backgroundColor !== "rgb(255, 255, 255)"`, &dark),
		chromedp.Click("#theme", chromedp.ByID),
		chromedp.EmulateViewport(1280, 900))
	require.True(t, fits, "the tasks page fits a phone's width")
	require.True(t, dark, "the theme button switches to dark")
	var completed string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/"),
		chromedp.WaitVisible(`[data-count="CANCELLED"]`, chromedp.ByQuery),
		chromedp.Text(`[data-count="CANCELLED"]`, &completed, chromedp.ByQuery))
	require.NotEqual(t, "0", completed)
	screenshot(t, tab, "overview")

	// Another org's person: no such task.
	stranger := browser(t)
	signIn(t, stranger, b.api, other)
	var heading string
	run(t, stranger, 30*time.Second,
		chromedp.Navigate(taskPage),
		chromedp.WaitVisible(`//h1[contains(., "not found")]`, chromedp.BySearch),
		chromedp.Text("h1", &heading, chromedp.ByQuery))
	require.Equal(t, "Task not found", heading)
}

// An address whose filter the API refuses (a creation time that is not RFC
// 3339, as a person may type or paste one) shows the API's error on the
// tasks page, naming the filter at fault; the page must not stay at
// "Loading…" with nothing said.
func TestDashboardTasksPageShowsARefusedFilter(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)

	var shown string
	run(t, tab, 20*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks?created_after=1h"),
		chromedp.WaitVisible(`main [role="status"] .error`, chromedp.ByQuery),
		chromedp.Text(`main [role="status"] .error`, &shown, chromedp.ByQuery))
	require.Contains(t, shown, "created_after")
	require.Contains(t, shown, "RFC 3339")
}

// A stream the API refuses for good (a filter it cannot read) is not asked
// for again and again: the browser does not say why a stream failed, the
// page asks the stream once itself, and a refusal that will not change
// stops it.
func TestDashboardStreamRefusedForGoodIsNotAskedAgain(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)

	var mu sync.Mutex
	asked := 0
	chromedp.ListenTarget(tab, func(ev any) {
		if r, ok := ev.(*network.EventRequestWillBeSent); ok && strings.Contains(r.Request.URL, "/v1/events/stream") {
			mu.Lock()
			asked++
			mu.Unlock()
		}
	})
	var shown string
	run(t, tab, 20*time.Second, network.Enable(),
		chromedp.Navigate(b.api+"/ui/tasks?type=Not%20a%20type"),
		chromedp.WaitVisible(`main [role="status"] .error`, chromedp.ByQuery),
		chromedp.Text(`main [role="status"] .error`, &shown, chromedp.ByQuery))
	require.Contains(t, shown, "type")
	// A retry came after 2 s, and another 4 s later.
	time.Sleep(7 * time.Second)
	mu.Lock()
	defer mu.Unlock()
	require.LessOrEqual(t, asked, 2, "the stream and the page's one question of it")
}

// A task's or a run's address with a malformed escape (typed by hand)
// shows the API's answer, not a page stuck at "Loading…".
func TestDashboardMalformedAddressesShowAnAnswer(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	for _, page := range []string{"/ui/tasks/%E0", "/ui/runs/%E0%A4"} {
		var shown string
		run(t, tab, 20*time.Second,
			chromedp.Navigate(b.api+page),
			chromedp.WaitVisible(`main [role="alert"]`, chromedp.ByQuery),
			chromedp.Text(`main`, &shown, chromedp.ByQuery))
		require.Contains(t, shown, "not found", page)
	}
}

// A list filtered to tasks made after a moment, empty so far, does not
// show an older task queued again (a retry) as a new one; a task made
// after the moment does appear.
func TestDashboardEmptyListShowsNoRetriedOldTaskAsNew(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	// No worker runs here: the old task is made FAILED by hand.
	old := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 10}, 1)
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET status = 'FAILED', completed_at = now(),
		version = version + 1 WHERE id = $1`, old)
	require.NoError(t, err)
	time.Sleep(20 * time.Millisecond)
	after := time.Now().UTC().Format(time.RFC3339Nano)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 20*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks?created_after="+after),
		chromedp.WaitVisible(`//main//p[contains(., "No task matches.")]`, chromedp.BySearch))
	resp, err := b.client.Post(b.api+"/v1/tasks/"+old.String()+"/retry", "application/json", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	fresh := b.sleepTask(t, 1, 10)
	var listed []string
	run(t, tab, 20*time.Second,
		chromedp.WaitVisible(`tr[data-task="`+fresh.String()+`"]`, chromedp.ByQuery),
		chromedp.Evaluate(`[...document.querySelectorAll("tr[data-task]")].map((r) => r.dataset.task)`, &listed))
	require.Equal(t, []string{fresh.String()}, listed)
}

// A list filtered by a moment given to the second keeps the second when
// the filter form is sent again.
func TestDashboardFilterKeepsTheSeconds(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	var shown string
	run(t, tab, 20*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks?created_after=2026-11-27T08:10:30Z"),
		chromedp.WaitVisible(`#f-created_after`, chromedp.ByQuery),
		// The counts come in above the form and move it down: a click
		// aimed before they came would land where the button was.
		chromedp.WaitVisible(`[data-count]`, chromedp.ByQuery),
		chromedp.Value(`#f-created_after`, &shown, chromedp.ByQuery))
	require.Equal(t, "2026-11-27T08:10:30", shown)
	run(t, tab, 20*time.Second, chromedp.Click(`form.filters button[type="submit"]`, chromedp.ByQuery))
	// The form's answer is a navigation: read the address until it lands.
	require.Eventually(t, func() bool {
		var at string
		return chromedp.Run(tab, chromedp.Location(&at)) == nil &&
			strings.Contains(at, "?created_after=2026-11-27T08%3A10%3A30.000Z")
	}, 20*time.Second, 50*time.Millisecond, "the filter sent again to the second")
}

// The overview's queues of an org whose tasks have all ended say that
// nothing waits or runs, not that there are no tasks: the cards above them
// count the ended ones.
func TestDashboardOverviewOfAnOrgWithNothingQueued(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET status = 'COMPLETED', completed_at = now(),
		version = version + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	tab := browser(t)
	signIn(t, tab, b.api, key)

	var completed, queues string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/"),
		chromedp.WaitVisible(`section[aria-labelledby="types"] p`, chromedp.ByQuery),
		chromedp.Text(`[data-count="COMPLETED"]`, &completed, chromedp.ByQuery),
		chromedp.Text(`section[aria-labelledby="types"] p`, &queues, chromedp.ByQuery))
	require.Equal(t, "1", completed)
	require.NotContains(t, queues, "No tasks", "the org has a task")
	require.Contains(t, queues, "waiting or running")
}

// A task's page with text that is long and unbroken (a URL, a hash, a
// base64 blob in its payload), Unicode, or looks like HTML: at a phone's
// width the page still does not scroll sideways (long lines wrap, or
// scroll in their own box), and the HTML-ish text shows as text.
func TestDashboardTaskPageWithLongTextFitsAPhone(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	long := strings.Repeat("ü0123456789abcdef", 24)
	html := `<img src=x onerror="window.pwned=1"><b>bold</b>`
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 10, "blob": long, "html": html}, 1)
	// A handler's report: its state text and an error, as long.
	_, err := b.pool.Exec(context.Background(), `WITH upd AS (UPDATE tasks SET state = $2, updated_at = now() WHERE id = $1 RETURNING *)
		INSERT INTO task_events (task_id, org_id, status, state, progress, actor, error)
		SELECT id, org_id, status, $2, progress, 'WORKER', $3 FROM upd`, id, "Fetching "+long+" "+html, "no such blob "+long)
	require.NoError(t, err)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	var fits, pwned bool
	var payload string
	run(t, tab, 30*time.Second,
		chromedp.EmulateViewport(390, 844),
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible(`//ol[@id="timeline"]/li[contains(., "no such blob")]`, chromedp.BySearch),
		chromedp.Evaluate(`document.documentElement.scrollWidth <= window.innerWidth`, &fits),
		chromedp.Evaluate(`window.pwned === 1`, &pwned),
		chromedp.Text("main", &payload, chromedp.ByQuery))
	require.False(t, pwned)
	require.Contains(t, payload, long)
	require.Contains(t, payload, `\"window.pwned=1\"`, "the HTML-ish text shows as text")
	if !fits {
		var wide []string
		run(t, tab, 10*time.Second, chromedp.Evaluate(`[...document.querySelectorAll("main *")].filter((e) =>
			e.getBoundingClientRect().right > window.innerWidth).map((e) => e.tagName + (e.id ? "#" + e.id : ""))`, &wide))
		t.Fatalf("the task page does not fit a phone's width: these stick out: %v", wide)
	}
}

// A session that ends while a page only follows a stream (its key revoked:
// the stream ends at its next heartbeat, and every reconnect is refused)
// sends the person to sign in, as every other refused request does,
// rather than leaving a page that looks live and never changes again.
func TestDashboardStreamOfARevokedKeySendsToSignIn(t *testing.T) {
	skipShort(t)
	t.Parallel()
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), "STREAM_HEARTBEAT=200ms")
	id := b.sleepTask(t, 1, 10)
	for _, page := range []string{"/ui/tasks", "/ui/tasks/" + id.String()} {
		resp, err := b.client.Post(b.api+"/v1/keys", "application/json", strings.NewReader(`{"name":"person","role":"admin"}`))
		require.NoError(t, err)
		var key struct{ ID, Secret string }
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&key))
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode)

		tab := browser(t)
		signIn(t, tab, b.api, key.Secret)
		run(t, tab, 30*time.Second, chromedp.Navigate(b.api+page),
			chromedp.WaitVisible("main table, #timeline li", chromedp.ByQuery))
		req, err := http.NewRequest(http.MethodDelete, b.api+"/v1/keys/"+key.ID, nil)
		require.NoError(t, err)
		resp, err = b.client.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)

		// The address is read until it is the sign-in page's; a read that
		// meets the navigation itself fails, and is tried again.
		var url string
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			var at string
			rctx, cancel := context.WithTimeout(tab, 5*time.Second)
			err := chromedp.Run(rctx, chromedp.Location(&at))
			cancel()
			if err != nil {
				continue
			}
			if url = at; strings.Contains(url, "/ui/login") {
				break
			}
		}
		require.Contains(t, url, "/ui/login?next="+strings.ReplaceAll(page, "/", "%2F"), "%s: the page of a revoked key asks to sign in", page)
	}
}

// "Older tasks" clicked twice before the next page came (a double click, an
// impatient second one) lists each task once.
func TestDashboardOlderTasksClickedTwiceListsEachTaskOnce(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	ids := b.submitMany(t, "dashboard.page", map[string]any{}, 60, nil)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	older := `//button[normalize-space()="Older tasks"]`
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(older, chromedp.BySearch),
		chromedp.Evaluate(`{
			const more = [...document.querySelectorAll("button")].find((b) => b.textContent === "Older tasks");
			more.click();
			more.click();
		}`, nil),
		chromedp.WaitNotVisible(older, chromedp.BySearch))
	time.Sleep(time.Second) // a second page, if one was asked for, has come
	var listed []string
	run(t, tab, 5*time.Second, chromedp.Evaluate(`[...document.querySelectorAll("tr[data-task]")].map((r) => r.dataset.task)`, &listed))
	require.Len(t, listed, len(ids), "each task once")
}

// The overview redraws itself every 5 s, a running run's page every 1.5 s;
// a keyboard user's place (the link or button they tabbed to) survives the
// redraw instead of falling back to the top of the page.
func TestDashboardRedrawsKeepTheKeyboardsPlace(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	link := `a[href="/ui/tasks?status=FAILED"]`
	var before, after string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/"),
		chromedp.WaitVisible(link, chromedp.ByQuery),
		chromedp.Focus(link, chromedp.ByQuery),
		chromedp.Evaluate(`document.activeElement.getAttribute("href")`, &before),
		chromedp.Sleep(6*time.Second), // a redraw
		chromedp.Evaluate(`document.activeElement.getAttribute("href")`, &after))
	require.Equal(t, "/ui/tasks?status=FAILED", before)
	require.Equal(t, before, after, "the focus stays on the link")

	// A running run's page redraws every 1.5 s; its Cancel button keeps
	// the focus, so that Enter still cancels.
	b.apply(t, diamondJobs)
	var started struct{ ID string }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/workflows/diamond/runs", map[string]any{}, http.StatusCreated), &started))
	var focused string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/runs/"+started.ID),
		chromedp.WaitVisible("#cancel-run", chromedp.ByID),
		chromedp.Focus("#cancel-run", chromedp.ByID),
		chromedp.Sleep(2*time.Second), // a redraw
		chromedp.Evaluate(`document.activeElement.id`, &focused))
	require.Equal(t, "cancel-run", focused, "the focus stays on the button")

	// A task's page redraws its buttons when the task's status changes
	// (PENDING, then IN_PROGRESS when a worker claims it): Cancel keeps
	// the focus.
	b.startWorker(t, "w1")
	var task struct{ ID string }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/tasks", map[string]any{"type": "demo.sleep",
		"payload": map[string]any{"steps": 100, "step_ms": 100}, "delay": "3s", "dedupe": false}, http.StatusCreated), &task))
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+task.ID),
		chromedp.WaitVisible("#cancel", chromedp.ByID),
		chromedp.Focus("#cancel", chromedp.ByID),
		chromedp.WaitVisible(`#status [data-status="IN_PROGRESS"]`, chromedp.ByQuery),
		chromedp.Evaluate(`document.activeElement.id`, &focused))
	require.Equal(t, "cancel", focused, "the focus stays on the task's Cancel button")
}

// Back from a task's page, the browser shows the list again from its
// back-forward cache, as it was left, without loading it again: the list's
// stream, closed when the page was hidden, opens again, and the tasks
// made meanwhile and after appear.
func TestDashboardListRestoredByBackStaysLive(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	first := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(`tr[data-task="`+first.String()+`"]`, chromedp.ByQuery),
		chromedp.Click(`tr[data-task="`+first.String()+`"] a`, chromedp.ByQuery),
		chromedp.WaitVisible("#bar", chromedp.ByID))
	away := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	// A page restored from the cache fires no load event, which
	// chromedp's navigation and waits expect: the page is asked instead.
	run(t, tab, 10*time.Second, chromedp.Evaluate(`history.back()`, nil))
	listed := func(id uuid.UUID) func() error {
		return func() error {
			var shown bool
			ctx, cancel := context.WithTimeout(tab, 2*time.Second)
			defer cancel()
			if err := chromedp.Run(ctx, chromedp.Evaluate(
				`location.pathname === "/ui/tasks" && !!document.querySelector('tr[data-task="`+id.String()+`"]')`, &shown)); err != nil {
				return err
			}
			if !shown {
				return fmt.Errorf("task %s not listed", id)
			}
			return nil
		}
	}
	testenv.Eventually(t, 20*time.Second, listed(away))
	after := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	testenv.Eventually(t, 20*time.Second, listed(after))
}

// "Older tasks" refused once (a 429, the API restarting) says so; clicked
// again once the API answers, it lists the next page, and the error of
// the failed try is gone rather than left above a list that loaded.
func TestDashboardOlderTasksErrorClearsOnceTheyLoad(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	ids := b.submitMany(t, "dashboard.page", map[string]any{}, 60, nil)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	older := `//button[normalize-space()="Older tasks"]`
	var shown string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(older, chromedp.BySearch),
		// The next page's request is answered 429 once, as the API's
		// rate limit would.
		chromedp.Evaluate(`{
			const real = window.fetch;
			window.fetch = (url, opts) => {
				if (String(url).includes("cursor=")) {
					window.fetch = real;
					return Promise.resolve(new Response(JSON.stringify({title: "Too Many Requests", detail: "slow down"}),
						{status: 429, headers: {"Content-Type": "application/problem+json"}}));
				}
				return real(url, opts);
			};
		}`, nil),
		chromedp.Click(older, chromedp.BySearch),
		chromedp.WaitVisible(`main [role="status"] .error`, chromedp.ByQuery),
		chromedp.Text(`main [role="status"] .error`, &shown, chromedp.ByQuery))
	require.Contains(t, shown, "slow down")
	var listed, errors int
	run(t, tab, 30*time.Second,
		chromedp.Click(older, chromedp.BySearch),
		chromedp.WaitNotVisible(older, chromedp.BySearch),
		chromedp.Evaluate(`document.querySelectorAll("tr[data-task]").length`, &listed),
		chromedp.Evaluate(`document.querySelectorAll("main .error:not(:empty)").length`, &errors))
	require.Equal(t, len(ids), listed)
	require.Zero(t, errors, "the error of the failed try is gone once the page loaded")
}

// The list's "Updated" column says how long ago each task last changed,
// and keeps saying it right while the page stays open: a task untouched
// since does not stay "50s ago" for ever.
func TestDashboardListUpdatedTimesMoveOn(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	_, err := b.pool.Exec(context.Background(), `UPDATE tasks SET updated_at = now() - interval '40 seconds' WHERE id = $1`, id)
	require.NoError(t, err)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	cell := `tr[data-task="` + id.String() + `"] .upd`
	var before, after string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(cell, chromedp.ByQuery),
		chromedp.Text(cell, &before, chromedp.ByQuery))
	require.Regexp(t, `^\d+s ago$`, before, "drawn before its first minute")
	// The page is left alone: only its own clock can move the text on.
	deadline := time.Now().Add(45 * time.Second)
	for after != "1m ago" && time.Now().Before(deadline) {
		run(t, tab, 10*time.Second, chromedp.Sleep(500*time.Millisecond), chromedp.Text(cell, &after, chromedp.ByQuery))
	}
	require.Equal(t, "1m ago", after, "a minute on, the list says so")
}

// The Theme button is a toggle (aria-pressed): a screen reader reads its
// name with its state, so the name must not change with the state. Dark,
// it is "Dark theme, pressed", never "Light theme, pressed", which says
// the opposite of what the page shows.
func TestDashboardThemeToggleSaysWhatIsOn(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	type toggle struct {
		Name    string `json:"name"`
		Pressed string `json:"pressed"`
		Dark    bool   `json:"dark"`
	}
	read := `(() => { const b = document.getElementById("theme");
		return {name: b.textContent, pressed: b.getAttribute("aria-pressed"),
			dark: getComputedStyle(document.body).backgroundColor !== "rgb(255, 255, 255)"}; })()`
	var before, after toggle
	run(t, tab, 20*time.Second,
		chromedp.Navigate(b.api+"/ui/"),
		chromedp.WaitVisible("#signout", chromedp.ByID),
		chromedp.Evaluate(read, &before),
		chromedp.Click("#theme", chromedp.ByID),
		chromedp.Evaluate(read, &after))
	require.NotEqual(t, before.Dark, after.Dark, "the button switches the theme")
	require.Equal(t, before.Name, after.Name, "a toggle's name stays as its state changes")
	for _, s := range []toggle{before, after} {
		require.Equal(t, "Dark theme", s.Name)
		require.Equal(t, fmt.Sprint(s.Dark), s.Pressed, "pressed when the dark theme shows")
	}
}

// A task's or a run's page that the API could not answer for now (a 503
// while it restarts, a 429) says so, and not that there is no such task:
// the person would give up on a task that exists.
func TestDashboardPageOfAnUnansweredReadIsNotNotFound(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	b.apply(t, diamondJobs)
	var started struct{ ID string }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/workflows/diamond/runs", map[string]any{}, http.StatusCreated), &started))

	tab := browser(t)
	signIn(t, tab, b.api, key)
	// The read of the task or run is answered 503 once, as an API that
	// restarts would answer it.
	run(t, tab, 10*time.Second, chromedp.ActionFunc(func(ctx context.Context) error {
		_, err := page.AddScriptToEvaluateOnNewDocument(`{
			const real = window.fetch;
			window.fetch = (url, opts) => {
				if (/^\/v1\/(tasks|runs)\/[^/]+$/.test(String(url))) {
					window.fetch = real;
					return Promise.resolve(new Response(JSON.stringify({title: "Service Unavailable", detail: "the API is starting; try again"}),
						{status: 503, headers: {"Content-Type": "application/problem+json"}}));
				}
				return real(url, opts);
			};
		}`).Do(ctx)
		return err
	}))
	for _, p := range []string{"/ui/tasks/" + id.String(), "/ui/runs/" + started.ID} {
		var heading, shown string
		run(t, tab, 20*time.Second,
			chromedp.Navigate(b.api+p),
			chromedp.WaitVisible(`main [role="alert"]`, chromedp.ByQuery),
			chromedp.Text("h1", &heading, chromedp.ByQuery),
			chromedp.Text(`main [role="alert"]`, &shown, chromedp.ByQuery))
		require.NotContains(t, heading, "not found", p)
		require.Contains(t, shown, "try again", p)
	}
}

// An answer that is not the API's (the error page of a proxy in front of
// an API that is down) says what failed, by its status, and not that the
// page could not parse it as JSON.
func TestDashboardProxysErrorPageSaysWhatFailed(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 10*time.Second, chromedp.ActionFunc(func(ctx context.Context) error {
		_, err := page.AddScriptToEvaluateOnNewDocument(`{
			const real = window.fetch;
			window.fetch = (url, opts) => {
				if (/^\/v1\/tasks\/[^/]+$/.test(String(url))) {
					return Promise.resolve(new Response("<html><body><h1>502 Bad Gateway</h1></body></html>",
						{status: 502, statusText: "Bad Gateway", headers: {"Content-Type": "text/html"}}));
				}
				return real(url, opts);
			};
		}`).Do(ctx)
		return err
	}))
	var heading, shown string
	run(t, tab, 20*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible(`main [role="alert"]`, chromedp.ByQuery),
		chromedp.Text("h1", &heading, chromedp.ByQuery),
		chromedp.Text(`main [role="alert"]`, &shown, chromedp.ByQuery))
	require.Equal(t, "Could not load the task", heading)
	require.Contains(t, shown, "502")
	require.NotContains(t, shown, "JSON")
}

// A task's Cancel refused twice (a 429) shows why once, not once a click.
func TestDashboardTaskPageRefusedActionSaysWhyOnce(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	var shown []string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible("#cancel", chromedp.ByID),
		chromedp.Evaluate(`{
			const real = window.fetch;
			window.fetch = (url, opts) => String(url).endsWith("/cancel")
				? Promise.resolve(new Response(JSON.stringify({title: "Too Many Requests", detail: "slow down"}),
					{status: 429, headers: {"Content-Type": "application/problem+json"}}))
				: real(url, opts);
		}`, nil),
		chromedp.Click("#cancel", chromedp.ByID),
		chromedp.WaitVisible(`main .error[role="alert"]`, chromedp.ByQuery),
		chromedp.Click("#cancel", chromedp.ByID),
		chromedp.Sleep(500*time.Millisecond),
		chromedp.Evaluate(`[...document.querySelectorAll('main .error[role="alert"]')].map((e) => e.textContent)`, &shown))
	require.Equal(t, []string{"slow down"}, shown)
}

// A task's page opened while the task waits shows, once a worker takes
// it, who runs it and since when, while it runs: not "—" until it ends.
func TestDashboardTaskPageShowsTheWorkerWhileItRuns(t *testing.T) {
	b := setup(t)
	b.startWorker(t, "w1")
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	var task struct{ ID string }
	require.NoError(t, json.Unmarshal(b.post(t, "/v1/tasks", map[string]any{"type": "demo.sleep",
		"payload": map[string]any{"steps": 100, "step_ms": 150}, "delay": "5s", "dedupe": false}, http.StatusCreated), &task))
	var status string
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+task.ID),
		chromedp.WaitVisible(`#status [data-status="PENDING"]`, chromedp.ByQuery))
	run(t, tab, 30*time.Second, chromedp.WaitVisible(`#status [data-status="IN_PROGRESS"]`, chromedp.ByQuery))
	details := func(term string) func() error {
		return func() error {
			var v string
			if err := chromedp.Run(tab, chromedp.Evaluate(`(() => {
				const dt = [...document.querySelectorAll("dl.details dt")].find((d) => d.textContent === "`+term+`");
				return dt ? dt.nextElementSibling.textContent : "";
			})()`, &v)); err != nil {
				return err
			}
			if v == "" || v == "—" {
				return fmt.Errorf("%s: %q", term, v)
			}
			return nil
		}
	}
	testenv.Eventually(t, 5*time.Second, details("Worker"))
	testenv.Eventually(t, 5*time.Second, details("Started"))
	run(t, tab, 5*time.Second, chromedp.Text("#status", &status, chromedp.ByID))
	require.Equal(t, "IN_PROGRESS", strings.TrimSpace(status), "the task still runs")
}

// A task's page follows the task's stream, which ends with the task; a
// retry made elsewhere (the CLI, another person, the list's bulk action)
// starts the task again, and the page left open must show that rather
// than the old ending, whose Retry button the API would now refuse.
func TestDashboardTaskPageShowsARetryMadeElsewhere(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	id := b.submit(t, "dash.retried", map[string]any{}, 1)
	b.post(t, "/v1/tasks/"+id.String()+"/cancel", nil, http.StatusOK)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks/"+id.String()),
		chromedp.WaitVisible(`#status [data-status="CANCELLED"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#retry", chromedp.ByID),
		chromedp.WaitVisible(`#timeline li [data-status="CANCELLED"]`, chromedp.ByQuery))
	// The page's stream has ended, and the page has read the task again
	// (as it does at the end): the retry comes after both.
	reads := `performance.getEntriesByType("resource").filter((e) => e.name.endsWith("/v1/tasks/` + id.String() + `")).length`
	run(t, tab, 10*time.Second, chromedp.Poll(reads+" >= 2", nil, chromedp.WithPollingInterval(50*time.Millisecond)))
	b.post(t, "/v1/tasks/"+id.String()+"/retry", nil, http.StatusOK)
	run(t, tab, 30*time.Second,
		chromedp.WaitVisible(`#status [data-status="PENDING"]`, chromedp.ByQuery),
		chromedp.WaitVisible("#cancel", chromedp.ByID))
}

// The tasks page's counts by status are those of the overview: they must
// follow the tasks as its rows do (a bulk action on this very page, a task
// cancelled elsewhere), not stay as they were when the page opened.
func TestDashboardTasksPageCountsFollowTheTasks(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	first := b.submit(t, "dash.counted", map[string]any{}, 1)
	b.submit(t, "dash.counted", map[string]any{}, 1)

	tab := browser(t)
	signIn(t, tab, b.api, key)
	run(t, tab, 30*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(`//span[@data-count="PENDING"][text()="2"]`, chromedp.BySearch),
		chromedp.WaitVisible(`//span[@data-count="CANCELLED"][text()="0"]`, chromedp.BySearch))
	b.post(t, "/v1/tasks/"+first.String()+"/cancel", nil, http.StatusOK)
	run(t, tab, 30*time.Second,
		chromedp.WaitVisible(`//span[@data-count="PENDING"][text()="1"]`, chromedp.BySearch),
		chromedp.WaitVisible(`//span[@data-count="CANCELLED"][text()="1"]`, chromedp.BySearch))
}

// The tasks page's counts come after the page is drawn: their place is kept
// until then, so a click aimed at the filter form before they come lands
// where it was aimed.
func TestDashboardTasksPageDoesNotMoveWhenTheCountsCome(t *testing.T) {
	b := setup(t)
	key := b.dashboardKey(t)
	tab := browser(t)
	signIn(t, tab, b.api, key)

	// The overview's requests are held until the test lets them go.
	held := make(chan fetch.RequestID, 16)
	chromedp.ListenTarget(tab, func(ev any) {
		if r, ok := ev.(*fetch.EventRequestPaused); ok {
			held <- r.RequestID
		}
	})
	run(t, tab, 10*time.Second, fetch.Enable().WithPatterns([]*fetch.RequestPattern{{URLPattern: "*/v1/overview*"}}))
	buttonTop := func() float64 {
		var top float64
		run(t, tab, 10*time.Second, chromedp.Evaluate(
			`document.querySelector('form.filters button[type="submit"]').getBoundingClientRect().top`, &top))
		return top
	}
	run(t, tab, 20*time.Second,
		chromedp.Navigate(b.api+"/ui/tasks"),
		chromedp.WaitVisible(`form.filters button[type="submit"]`, chromedp.ByQuery))
	var id fetch.RequestID
	select {
	case id = <-held:
	case <-time.After(10 * time.Second):
		t.Fatal("the page did not ask for the counts")
	}
	before := buttonTop()
	run(t, tab, 10*time.Second, fetch.ContinueRequest(id),
		chromedp.WaitVisible(`//span[@data-count="PENDING"][text()="0"]`, chromedp.BySearch))
	require.Equal(t, before, buttonTop())
}

// A stream refused because the org holds its most live streams (429) is
// said on the page, which would otherwise look live and not change, and is
// asked for again once one is let go.
func TestDashboardStreamRefusedForTheOrgsCapSaysSoAndComesBack(t *testing.T) {
	skipShort(t)
	t.Parallel()
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), "STREAM_MAX_PER_ORG=1")
	key := b.dashboardKey(t)
	id := b.sleepTask(t, 1, 10)
	tab := browser(t)
	signIn(t, tab, b.api, key)
	for _, page := range []string{"/ui/tasks", "/ui/tasks/" + id.String()} {
		// The org's one stream is held elsewhere; the one the page had is
		// let go with it.
		var held *sseStream
		for deadline := time.Now().Add(20 * time.Second); held == nil && time.Now().Before(deadline); {
			s, status := b.openStream(t, "/v1/events/stream", -1)
			if status == http.StatusOK {
				held = s
				break
			}
			require.Equal(t, http.StatusTooManyRequests, status)
			run(t, tab, 5*time.Second, chromedp.Navigate("about:blank"))
		}
		require.NotNil(t, held, "the org's one stream")

		var shown string
		run(t, tab, 30*time.Second, chromedp.Navigate(b.api+page),
			chromedp.WaitVisible("#live", chromedp.ByID),
			chromedp.Text("#live", &shown, chromedp.ByID))
		require.Contains(t, shown, "Live updates paused", page)
		require.Contains(t, shown, "Trying again in 5 s", page)

		held.cancel()
		held.resp.Body.Close()
		run(t, tab, 30*time.Second, chromedp.WaitNotVisible("#live", chromedp.ByID))
	}
	// The list's stream, open again, brings a new task.
	run(t, tab, 30*time.Second, chromedp.Navigate(b.api+"/ui/tasks"), chromedp.WaitVisible("main table", chromedp.ByQuery))
	fresh := b.submit(t, "dash.capped", map[string]any{}, 1)
	run(t, tab, 30*time.Second, chromedp.WaitVisible(`tr[data-task="`+fresh.String()+`"]`, chromedp.ByQuery))
}
