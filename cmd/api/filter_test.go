package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// listIDs lists tasks with the query and returns their ids, in order.
func (b *testBundle) listIDs(t *testing.T, query url.Values, header ...string) []string {
	t.Helper()
	resp := b.do(t, http.MethodGet, "/v1/tasks?"+query.Encode(), "", "", header...)
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	var page struct{ Tasks []struct{ ID string } }
	require.NoError(t, json.Unmarshal(resp.body, &page))
	ids := []string{}
	for _, tk := range page.Tasks {
		ids = append(ids, tk.ID)
	}
	return ids
}

// A listing narrows to a creation window, to one task by id, or to the
// tasks whose metadata holds a key=value; the filters combine, page, and
// keep within what the caller sees.
func TestListFiltersByCreationIDAndMetadata(t *testing.T) {
	t.Parallel()
	b := setup(t)
	old := b.submitTask(t, `{"type":"lf.a","payload":{"n":1},"metadata":{"team":"billing"}}`)
	older := b.submitTask(t, `{"type":"lf.a","payload":{"n":2},"metadata":{"team":"billing","n":5}}`)
	recent := b.submitTask(t, `{"type":"lf.b","payload":{"n":3},"metadata":{"team":"ops"}}`)
	hidden := b.submitTask(t, `{"type":"lf.a","payload":{"n":4},"metadata":{"team":"billing"},"visibility":["seers"]}`)
	b.exec(t, `UPDATE tasks SET created_at = now() - interval '1 day' WHERE id = $1`, old)
	b.exec(t, `UPDATE tasks SET created_at = now() - interval '2 days' WHERE id = $1`, older)
	outsider, _ := b.db.Key(t, "test", auth.Reader)
	otherOrg, _ := b.db.Key(t, "other", auth.Admin)
	now := time.Now().UTC()
	at := func(d time.Duration) string { return now.Add(d).Format(time.RFC3339Nano) }
	q := func(kv ...string) url.Values {
		v := url.Values{}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}

	require.Equal(t, []string{hidden, recent}, b.listIDs(t, q("created_after", at(-12*time.Hour))))
	require.Equal(t, []string{older, old}, b.listIDs(t, q("created_before", at(-12*time.Hour))), "newest id first")
	require.Equal(t, []string{old}, b.listIDs(t, q("created_after", at(-36*time.Hour), "created_before", at(-12*time.Hour))))
	require.Equal(t, []string{older, old}, b.listIDs(t, q("created_before", at(-12*time.Hour), "type", "lf.a", "status", "PENDING")))

	require.Equal(t, []string{recent}, b.listIDs(t, q("q", recent)))
	require.Equal(t, []string{hidden, older, old}, b.listIDs(t, q("q", "team=billing")))
	require.Equal(t, []string{older}, b.listIDs(t, q("q", "n=5")), "values compare as text: a number matches its digits")
	require.Equal(t, []string{old}, b.listIDs(t, q("q", "team=billing", "created_after", at(-36*time.Hour), "type", "lf.a", "created_before", at(-time.Hour))))
	require.Empty(t, b.listIDs(t, q("q", "team=")), "an empty value matches only an empty value")
	require.Empty(t, b.listIDs(t, q("q", "team=billing", "type", "lf.b")))

	// Paged with its filters.
	require.Equal(t, []string{hidden}, b.listIDs(t, q("q", "team=billing", "limit", "1")))
	page := b.get(t, "/v1/tasks?"+q("q", "team=billing", "limit", "2").Encode()).json(t)
	require.NotEmpty(t, page["next_cursor"])
	require.Equal(t, []string{old}, b.listIDs(t, q("q", "team=billing", "limit", "2", "cursor", page["next_cursor"].(string))))

	// Within what the caller sees.
	require.Equal(t, []string{older, old}, b.listIDs(t, q("q", "team=billing"), "Authorization", "Bearer "+outsider))
	require.Empty(t, b.listIDs(t, q("q", hidden), "Authorization", "Bearer "+outsider))
	require.Empty(t, b.listIDs(t, q("q", recent), "Authorization", "Bearer "+otherOrg))
}

// Bad filters are 422s naming the parameter.
func TestListRefusesBadFilters(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, tt := range []struct {
		name  string
		query url.Values
		field string
	}{
		{"created_after not a time", url.Values{"created_after": {"yesterday"}}, "created_after"},
		{"created_before without a zone", url.Values{"created_before": {"2026-01-02T15:04:05"}}, "created_before"},
		{"an empty window", url.Values{"created_after": {"2026-01-02T00:00:00Z"}, "created_before": {"2026-01-02T00:00:00Z"}}, "created_before"},
		{"q neither an id nor key=value", url.Values{"q": {"billing"}}, "q"},
		{"q a UUID of another form", url.Values{"q": {"0190c8a500007000800000000000000a"}}, "q"},
		{"q with an empty key", url.Values{"q": {"=billing"}}, "q"},
		{"q with a NUL", url.Values{"q": {"team=a\x00b"}}, "q"},
		// The zero time is how an absent bound is kept: as a bound it
		// would silently select every task.
		{"created_before at the zero time", url.Values{"created_before": {"0001-01-01T00:00:00Z"}}, "created_before"},
		{"created_after at the zero time", url.Values{"created_after": {"0001-01-01T00:00:00Z"}}, "created_after"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			resp := b.get(t, "/v1/tasks?"+tt.query.Encode())
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
			require.Equal(t, tt.field, resp.json(t)["field"])
		})
	}
}

// A query string that cannot be parsed is a 400, never a listing (or a
// stream) of everything: Go drops the pairs it cannot read, and the filter
// they held would be silently ignored.
func TestAMalformedQueryIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.submitTask(t, `{"type":"mq.a","payload":{}}`)
	for _, path := range []string{
		"/v1/tasks?status=FAILED%zz",
		"/v1/tasks?status=FAILED;type=mq.b",
		"/v1/tasks?type=mq.b&status=%",
		"/v1/tasks/00000000-0000-7000-8000-000000000000/events?limit=1%zz",
		"/v1/events/stream?type=mq.b%zz",
	} {
		resp := b.get(t, path)
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", path, resp.body)
		require.Equal(t, "urn:conveyor:problem:malformed", resp.json(t)["type"], path)
	}
}

// A task's history is read whole by following next_cursor, a page at a
// time, newest first: no event is skipped or repeated, and one added while
// paging does not shift the pages after it.
func TestTaskEventsPageThroughTheWholeHistory(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.submitTask(t, `{"type":"ev.page","payload":{}}`)
	// A long history: the submit's event and 120 progress reports.
	b.exec(t, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
		SELECT id, org_id, 'PENDING', 'step ' || g, 0, 'WORKER' FROM tasks, generate_series(1, 120) g WHERE id = $1`, id)
	var want []int64
	require.NoError(t, b.db.Pool.QueryRow(context.Background(),
		`SELECT array_agg(id ORDER BY id DESC) FROM task_events WHERE task_id = $1`, id).Scan(&want))
	require.Len(t, want, 121)

	type page struct {
		Events     []struct{ ID int64 }
		NextCursor string `json:"next_cursor"`
	}
	read := func(query string) page {
		t.Helper()
		resp := b.get(t, "/v1/tasks/"+id+"/events?"+query)
		require.Equal(t, http.StatusOK, resp.status, string(resp.body))
		var p page
		require.NoError(t, json.Unmarshal(resp.body, &p))
		return p
	}
	var got []int64
	var sizes []int
	cursor := ""
	for range 10 {
		q := url.Values{"limit": {"50"}}
		if cursor != "" {
			q.Set("cursor", cursor)
		}
		p := read(q.Encode())
		sizes = append(sizes, len(p.Events))
		for _, e := range p.Events {
			got = append(got, e.ID)
		}
		if cursor == "" {
			// Written after the first page was read: newer than it, so
			// on none of the pages that follow.
			b.exec(t, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
				SELECT id, org_id, 'PENDING', 'late', 0, 'WORKER' FROM tasks WHERE id = $1`, id)
		}
		if cursor = p.NextCursor; cursor == "" {
			break
		}
	}
	require.Equal(t, []int{50, 50, 21}, sizes)
	require.Equal(t, want, got, "every event once, newest first")

	// A full last page has no cursor: none that would read an empty page.
	last := read("limit=61&cursor=" + url.QueryEscape(read("limit=61").NextCursor))
	require.Len(t, last.Events, 61)
	require.Empty(t, last.NextCursor)

	// Without a limit, the default page (50) also says where to go on.
	require.NotEmpty(t, read("").NextCursor)
	require.Empty(t, read("limit=100&cursor="+url.QueryEscape(read("limit=100").NextCursor)).NextCursor,
		"the last page says there is no other")

	// A cursor that is not one of this endpoint's is a 422 naming it; a
	// listing's cursor is no events cursor.
	b.submitTask(t, `{"type":"ev.page","payload":{"n":2}}`) // a second task, for a listing's cursor
	listCursor := b.get(t, "/v1/tasks?limit=1").json(t)["next_cursor"].(string)
	for _, c := range []string{"zzz", listCursor, "AAAAAAAAAAA"} {
		resp := b.get(t, "/v1/tasks/"+id+"/events?cursor="+url.QueryEscape(c))
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, c+": "+string(resp.body))
		require.Equal(t, "cursor", resp.json(t)["field"])
	}
}

// A page that holds the listing's last rows has no next_cursor, even when
// it is full: a cursor is given only when more rows remain, so that a
// client (the CLI's "more:" line, the dashboard's button) never offers a
// page that comes back empty.
func TestListingsGiveNoCursorOnTheLastPage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	first := b.submitTask(t, `{"type":"lp.a","payload":{"n":1}}`)
	b.submitTask(t, `{"type":"lp.a","payload":{"n":2}}`)
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/roles", `{"slug":"ops"}`).status)
	for i := range 2 {
		u := b.post(t, "/v1/users", `{"external_id":"lp|`+string(rune('a'+i))+`","role":"reader"}`)
		require.Equal(t, http.StatusCreated, u.status, string(u.body))
		require.Equal(t, http.StatusNoContent,
			b.do(t, http.MethodPut, "/v1/roles/ops/members/"+u.json(t)["id"].(string), "", "").status)
	}
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/keys", `{"name":"lp","role":"reader"}`).status)

	// Each listing has two rows: a page of one says more remain, a page of
	// two, and the page after the first, hold the last and say none do.
	for _, path := range []string{"/v1/tasks", "/v1/tasks/" + first + "/events", "/v1/keys", "/v1/users",
		"/v1/roles/ops/members"} {
		if path == "/v1/tasks/"+first+"/events" {
			b.exec(t, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
				SELECT id, org_id, 'PENDING', 'again', 0, 'WORKER' FROM tasks WHERE id = $1`, first)
		}
		one := b.get(t, path+"?limit=1")
		require.Equal(t, http.StatusOK, one.status, string(one.body))
		cursor, _ := one.json(t)["next_cursor"].(string)
		require.NotEmpty(t, cursor, "%s: more remain after the first", path)

		last := b.get(t, path+"?limit=1&cursor="+url.QueryEscape(cursor))
		require.Equal(t, http.StatusOK, last.status, string(last.body))
		require.NotContains(t, last.json(t), "next_cursor", "%s: the second row is the last: %s", path, last.body)

		whole := b.get(t, path+"?limit=2")
		require.Equal(t, http.StatusOK, whole.status, string(whole.body))
		require.NotContains(t, whole.json(t), "next_cursor", "%s: a full page of the last rows: %s", path, whole.body)
	}
}

// An events cursor reads on only the history of the task it came from:
// given with another task's id, it would answer a page of that task cut at
// a place in the first one's history (here: none at all, all of the second
// task's events being newer), and look like the whole of it.
func TestTaskEventsRefuseAnotherTasksCursor(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.submitTask(t, `{"type":"ev.other","payload":{"n":1}}`)
	b.exec(t, `INSERT INTO task_events (task_id, org_id, status, state, progress, actor)
		SELECT id, org_id, 'PENDING', 'again', 0, 'WORKER' FROM tasks WHERE id = $1`, a)
	other := b.submitTask(t, `{"type":"ev.other","payload":{"n":2}}`)
	cursor, _ := b.get(t, "/v1/tasks/"+a+"/events?limit=1").json(t)["next_cursor"].(string)
	require.NotEmpty(t, cursor)

	resp := b.get(t, "/v1/tasks/"+other+"/events?cursor="+url.QueryEscape(cursor))
	require.Equal(t, http.StatusUnprocessableEntity, resp.status, string(resp.body))
	require.Equal(t, "cursor", resp.json(t)["field"])

	// Its own task reads on with it.
	resp = b.get(t, "/v1/tasks/"+a+"/events?cursor="+url.QueryEscape(cursor))
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	require.Len(t, resp.json(t)["events"], 1)
}
