package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
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
	key, err := postgres.NewDirectory(b.pool).Bootstrap(context.Background(), testdb.TestOrg, "dashboard")
	require.NoError(t, err)
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

// The overview's queues of an org whose tasks have all ended say that
// nothing waits or runs, not that there are no tasks: the cards above them
// count the ended ones.
func TestDashboardOverviewOfAnOrgWithNothingQueued(t *testing.T) {
	b := setup(t)
	key, err := postgres.NewDirectory(b.pool).Bootstrap(context.Background(), testdb.TestOrg, "dashboard")
	require.NoError(t, err)
	id := b.submit(t, "demo.sleep", map[string]any{"steps": 1}, 1)
	_, err = b.pool.Exec(context.Background(), `UPDATE tasks SET status = 'COMPLETED', completed_at = now(),
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
