package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/httpapi"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Who may call what, black box: every operation of openapi.yaml is called,
// against a real API that accepts API keys and OpenID Connect tokens, by
// every kind of caller it must refuse and by those it must let in. A route
// added to the document without an entry in authOps fails the test, and so
// does one added to the router without the document (TestOpenAPIMatchesRoutes).

const (
	specFile     = "../../internal/httpapi/openapi.yaml"
	oidcAudience = "conveyor"
	// authTTL is the AUTH_CACHE_TTL of these tests: how long a revoked key
	// may still work.
	authTTL = 200 * time.Millisecond
	// seers is the org role that the restricted tasks of org A name.
	seers = "seers"
)

var roles = []auth.Role{auth.Reader, auth.Writer, auth.Admin}

// TestEveryOperationAdmitsOnlyItsCallers walks openapi.yaml: each
// authenticated operation refuses missing and bad credentials (401), roles
// weaker than its x-required-role (403), another org's admin (404, or its
// own rows only) and callers outside a task's visibility (404, 403 on
// submission, absent from lists); and lets in a key and an OIDC user of its
// role.
func TestEveryOperationAdmitsOnlyItsCallers(t *testing.T) {
	t.Parallel()
	ops := specOperations(t)
	var public []string
	for _, op := range ops {
		if op.public {
			public = append(public, op.name())
		}
	}
	require.ElementsMatch(t, []string{"GET /healthz", "GET /readyz", "GET /metrics", "GET /openapi.yaml"}, public,
		"only the ops endpoints are public (security: [])")
	for name := range authOps {
		require.True(t, slices.ContainsFunc(ops, func(op specOp) bool { return op.name() == name }),
			"authOps teaches %s, which openapi.yaml does not document", name)
	}

	w := newAuthWorld(t)
	for _, op := range ops {
		if op.public {
			continue
		}
		t.Run(op.name(), func(t *testing.T) {
			t.Parallel()
			how, ok := authOps[op.name()]
			require.True(t, ok, "new route %s: teach the auth test how to call it (authOps in cmd/api/auth_test.go)", op.name())
			need, err := auth.ParseRole(op.role)
			require.NoError(t, err, "x-required-role of %s", op.name())
			w.check(t, op, need, how)
		})
	}
}

// check runs every case against one operation. The refusals share one
// request on fresh resources, which the allowed caller then uses: nothing a
// refused caller sent may have changed it.
func (w *authWorld) check(t *testing.T, op specOp, need auth.Role, how opSpec) {
	call := w.prepare(t, op, how)

	t.Run("no or bad credentials: 401", func(t *testing.T) {
		for _, c := range w.refused {
			resp := w.send(t, call, c.header)
			require.Equal(t, http.StatusUnauthorized, resp.status, "%s: %s", c.name, resp.body)
			require.Equal(t, `Bearer realm="conveyor"`, resp.header.Get("WWW-Authenticate"), c.name)
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"), c.name)
			if c.mention != "" {
				require.Contains(t, resp.json(t)["detail"], c.mention, c.name)
			}
		}
	})

	if weaker := roles[:slices.Index(roles, need)]; len(weaker) > 0 {
		t.Run("weaker role: 403", func(t *testing.T) {
			callers := []caller{w.demoted}
			for _, role := range weaker {
				callers = append(callers, w.keys[role], w.users[role])
			}
			for _, c := range callers {
				resp := w.send(t, call, c.header)
				require.Equal(t, http.StatusForbidden, resp.status, "%s: %s", c.name, resp.body)
				require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			}
		})
	}

	t.Run("another org's admin: 404 or its own rows", func(t *testing.T) {
		if len(call.names) > 0 && !how.orgless {
			resp := w.send(t, call, w.adminB.header)
			require.Equal(t, http.StatusNotFound, resp.status, string(resp.body))
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			requireAsIfMissing(t, w, call, resp, w.adminB)
			return
		}
		// Without a path parameter the call acts in org B: it must not
		// touch or show a row of org A.
		resp := w.send(t, w.prepare(t, op, how), w.adminB.header)
		require.True(t, resp.status >= 200 && resp.status < 300, "%d %s", resp.status, resp.body)
		for _, id := range w.orgAIDs {
			requireAbsent(t, string(resp.body), id, "org B sees org A's %s", id)
		}
		if how.vis == visBulk {
			require.EqualValues(t, 0, resp.json(t)["matched"], "org B's action counts org A's task")
		}
		// A query naming org A's rows answers as one naming rows that
		// exist nowhere.
		if how.foreign == nil {
			return
		}
		path, _, _ := strings.Cut(w.prepare(t, op, how).path, "?")
		for _, f := range how.foreign(w) {
			c := apiCall{method: op.method, path: path + f.query(f.id)}
			resp := w.send(t, c, w.adminB.header)
			missing := w.send(t, apiCall{method: op.method, path: path + f.query(uuid.NewString())}, w.adminB.header)
			require.Equal(t, missing.status, resp.status, "%s: %s, and for what is nowhere: %s", c.path, resp.body, missing.body)
			if resp.status >= 300 {
				require.Equal(t, missing.json(t)["detail"], resp.json(t)["detail"], c.path)
			}
			for _, id := range w.orgAIDs {
				requireAbsent(t, string(resp.body), id, "org B sees org A's %s through %s", id, c.path)
			}
		}
	})

	if how.vis != visNone {
		t.Run("outside the task's visibility", func(t *testing.T) {
			for _, c := range []caller{w.outsiderKeys[need], w.outsiderUsers[need]} {
				resp := w.send(t, call, c.header)
				switch how.vis {
				case visByID:
					require.Equal(t, http.StatusNotFound, resp.status, "%s: %s", c.name, resp.body)
					requireAsIfMissing(t, w, call, resp, c)
				case visSubmit:
					require.Equal(t, http.StatusForbidden, resp.status, "%s: %s", c.name, resp.body)
					require.Contains(t, resp.json(t)["field"], "visibility", c.name)
				case visList:
					require.Equal(t, http.StatusOK, resp.status, "%s: %s", c.name, resp.body)
					require.Contains(t, string(resp.body), w.openTask, "%s sees the open task", c.name)
					requireAbsent(t, string(resp.body), w.restrictedTask, "%s sees a task restricted to %s", c.name, seers)
				case visBulk:
					require.Equal(t, http.StatusOK, resp.status, "%s: %s", c.name, resp.body)
					require.EqualValues(t, 0, resp.json(t)["matched"], "%s counts a task restricted to %s", c.name, seers)
				}
			}
		})
	}

	t.Run("allowed: key, then OIDC user", func(t *testing.T) {
		resp := w.send(t, call, w.keys[need].header)
		w.requireSuccess(t, op, resp, w.keys[need])
		if how.sees != nil {
			for _, id := range how.sees(w) {
				require.Contains(t, string(resp.body), id)
			}
		}
		for name, want := range how.answers {
			require.EqualValues(t, want, resp.json(t)[name], "%s in %s", name, resp.body)
		}
		resp = w.send(t, w.prepare(t, op, how), w.users[need].header)
		w.requireSuccess(t, op, resp, w.users[need])
	})
}

// requireAsIfMissing checks that resp, c's answer to call, is the answer
// c gets when call's path names what exists nowhere: the same status and
// the same detail but for the names, so that neither tells the caller the
// resource is there.
func requireAsIfMissing(t *testing.T, w *authWorld, call apiCall, resp response, c caller) {
	t.Helper()
	ghost := call
	var pairs []string
	for _, name := range call.names {
		other := name + "-ghost"
		if uuid.Validate(name) == nil {
			other = uuid.NewString()
		}
		ghost.path = strings.ReplaceAll(ghost.path, name, other)
		pairs = append(pairs, other, name)
	}
	missing := w.send(t, ghost, c.header)
	require.Equal(t, missing.status, resp.status, "%s: %s, and for what is nowhere: %s", c.name, resp.body, missing.body)
	got, want := resp.json(t), missing.json(t)
	require.Equal(t, strings.NewReplacer(pairs...).Replace(fmt.Sprint(want["detail"])), fmt.Sprint(got["detail"]),
		"%s: the detail tells the resource exists", c.name)
	require.Equal(t, want["type"], got["type"], c.name)
}

func (w *authWorld) requireSuccess(t *testing.T, op specOp, resp response, c caller) {
	t.Helper()
	require.True(t, resp.status >= 200 && resp.status < 300, "%s: %d %s", c.name, resp.status, resp.body)
	require.Contains(t, op.responses, strconv.Itoa(resp.status), "%s answered %d, which openapi.yaml does not document", op.name(), resp.status)
}

// opSpec says how to call one operation as org A.
type opSpec struct {
	// prepare makes the org A resources the call needs, fresh each time,
	// and returns its path parameters and body.
	prepare func(t *testing.T, w *authWorld) (params map[string]string, body string)
	query   string
	vis     visibility
	// sees lists ids the allowed caller's answer must show.
	sees func(w *authWorld) []string
	// answers are members the allowed caller's JSON answer must hold.
	answers map[string]any
	// contentType is the body's, when not JSON.
	contentType string
	// orgless: the path names no org's resource but something every org
	// has (a task type), so another org's call acts on its own.
	orgless bool
	// foreign lists queries that name org A's rows (a task, a cursor):
	// org B's answer to each must be its answer to the same query naming
	// a row that exists nowhere.
	foreign func(w *authWorld) []foreignQuery
}

// foreignQuery is a query string naming one row of org A.
type foreignQuery struct {
	id    string
	query func(id string) string
}

// foreignCursor is the query asking for the page after the row id, as
// listings of tasks, keys and users write their cursors.
func foreignCursor(id string) foreignQuery {
	return foreignQuery{id: id, query: func(id string) string {
		u := uuid.MustParse(id)
		return "?cursor=" + base64.RawURLEncoding.EncodeToString(u[:])
	}}
}

// foreignAfter is the query asking for the runs after the run id.
func foreignAfter(id string) foreignQuery {
	return foreignQuery{id: id, query: func(id string) string { return "?after=" + id }}
}

// visibility says how a task's visibility shows in an operation.
type visibility int

const (
	visNone   visibility = iota
	visByID              // the path names a restricted task: 404 for outsiders
	visSubmit            // the body restricts the task: 403 for outsiders
	visList              // a listing: outsiders do not see restricted tasks
	visBulk              // an action on the tasks a filter matches: outsiders count (and change) none
)

// authOps teaches the test every authenticated operation, by "METHOD path"
// as openapi.yaml has it.
var authOps = map[string]opSpec{
	"GET /v1/whoami": {sees: func(w *authWorld) []string { return []string{w.orgA} }},

	"GET /v1/tasks": {query: "?limit=500", vis: visList,
		sees: func(w *authWorld) []string { return []string{w.openTask, w.restrictedTask} },
		foreign: func(w *authWorld) []foreignQuery {
			return []foreignQuery{foreignCursor(w.openTask),
				{id: w.restrictedTask, query: func(id string) string { return "?q=" + id }}}
		}},
	"POST /v1/tasks": {vis: visSubmit, prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return nil, fmt.Sprintf(`{"type":"auth.submit","payload":{"n":%d},"visibility":[%q]}`, w.seq(), seers)
	}},
	"POST /v1/tasks/batch": {vis: visSubmit, prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return nil, fmt.Sprintf(`{"tasks":[{"type":"auth.batch","payload":{"n":%d},"visibility":[%q]}]}`, w.seq(), seers)
	}},
	"GET /v1/tasks/{id}": {vis: visByID, prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"id": w.restrictedTask}, ""
	}},
	"GET /v1/tasks/{id}/events": {vis: visByID, prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"id": w.restrictedTask}, ""
	}},
	// A stream of a finished task ends on its own; the org's stream is
	// read for a moment (see do), from its first event.
	"GET /v1/tasks/{id}/stream": {vis: visByID, prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		id := w.newTask(t, true)
		w.asAdmin(t, http.MethodPost, "/v1/tasks/"+id+"/cancel", "")
		return map[string]string{"id": id}, ""
	}},
	"GET /v1/events/stream": {query: "?last_event_id=0", vis: visList,
		sees: func(w *authWorld) []string { return []string{w.openTask, w.restrictedTask} }},
	"POST /v1/tasks/{id}/cancel": {vis: visByID, prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"id": w.newTask(t, true)}, ""
	}},
	"POST /v1/tasks/{id}/retry": {vis: visByID, prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		id := w.newTask(t, true)
		w.asAdmin(t, http.MethodPost, "/v1/tasks/"+id+"/cancel", "")
		return map[string]string{"id": id}, ""
	}},

	// A bulk action's filter matches one fresh restricted task: every
	// caller refused before the allowed one must have left it alone.
	"POST /v1/tasks/cancel": {vis: visBulk, answers: map[string]any{"matched": 1, "cancelled": 1},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			typ := fmt.Sprintf("auth.bulk-%d", w.seq())
			w.newTaskOf(t, typ)
			return nil, `{"filter":{"type":"` + typ + `"}}`
		}},
	"POST /v1/tasks/retry": {vis: visBulk, answers: map[string]any{"matched": 1, "retried": 1},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			typ := fmt.Sprintf("auth.bulk-%d", w.seq())
			w.asAdmin(t, http.MethodPost, "/v1/tasks/"+w.newTaskOf(t, typ)+"/cancel", "")
			return nil, `{"filter":{"type":"` + typ + `","status":"CANCELLED"}}`
		}},
	"GET /v1/overview": {},

	"POST /v1/keys": {prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return nil, fmt.Sprintf(`{"name":"key-%d","role":"reader"}`, w.seq())
	}},
	"GET /v1/keys": {sees: func(w *authWorld) []string { return w.keyIDs },
		foreign: func(w *authWorld) []foreignQuery { return []foreignQuery{foreignCursor(w.keyIDs[0])} }},
	"DELETE /v1/keys/{id}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"id": w.newKey(t)}, ""
	}},

	"POST /v1/users": {prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return nil, fmt.Sprintf(`{"external_id":"person-%d","email":"p%d@example.com","role":"reader"}`, w.seq(), w.seq())
	}},
	"GET /v1/users": {sees: func(w *authWorld) []string { return w.userIDs },
		foreign: func(w *authWorld) []foreignQuery { return []foreignQuery{foreignCursor(w.userIDs[0])} }},
	"PATCH /v1/users/{id}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		id, _ := w.newUser(t, auth.Reader)
		return map[string]string{"id": id}, `{"role":"writer"}`
	}},
	"DELETE /v1/users/{id}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		id, _ := w.newUser(t, auth.Reader)
		return map[string]string{"id": id}, ""
	}},

	"POST /v1/roles": {prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
		return nil, fmt.Sprintf(`{"slug":"role-%d"}`, w.seq())
	}},
	"GET /v1/roles": {sees: func(w *authWorld) []string { return []string{w.seersID} }},
	"DELETE /v1/roles/{slug}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"slug": w.newRole(t, false)}, ""
	}},
	"GET /v1/roles/{slug}/members": {
		prepare: func(*testing.T, *authWorld) (map[string]string, string) {
			return map[string]string{"slug": seers}, ""
		},
		sees: func(w *authWorld) []string { return w.seerIDs },
	},
	// Org B has a role of the same slug: its admin is refused for the user.
	"PUT /v1/roles/{slug}/members/{user_id}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		user, _ := w.newUser(t, auth.Reader)
		return map[string]string{"slug": w.newRole(t, true), "user_id": user}, ""
	}},
	"DELETE /v1/roles/{slug}/members/{user_id}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		user, _ := w.newUser(t, auth.Reader)
		slug := w.newRole(t, true)
		w.asAdmin(t, http.MethodPut, "/v1/roles/"+slug+"/members/"+user, "")
		return map[string]string{"slug": slug, "user_id": user}, ""
	}},

	// Every call on a named job gets a fresh job of org A; org B has no job
	// of that name.
	"GET /v1/jobs": {sees: func(w *authWorld) []string { return []string{w.jobID} }},
	"POST /v1/jobs/apply": {contentType: "application/yaml", query: "?prune=false",
		prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
			return nil, jobFile(fmt.Sprintf("auth-apply-%d", w.seq()))
		}},
	"GET /v1/jobs/{name}": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"name": w.newJob(t)}, ""
	}},
	"POST /v1/jobs/{name}/trigger": {prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
		return map[string]string{"name": w.newJob(t)}, ""
	}},
	"POST /v1/jobs/{name}/pause": {answers: map[string]any{"paused": true},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			return map[string]string{"name": w.newJob(t)}, ""
		}},
	"POST /v1/jobs/{name}/resume": {answers: map[string]any{"paused": false},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			name := w.newJob(t)
			w.asAdmin(t, http.MethodPost, "/v1/jobs/"+name+"/pause", "")
			return map[string]string{"name": name}, ""
		}},
	"GET /v1/types": {sees: func(*authWorld) []string { return []string{limitedType} }},
	"POST /v1/types/{type}/pause": {orgless: true, answers: map[string]any{"paused": true},
		prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
			return map[string]string{"type": fmt.Sprintf("auth.paused-%d", w.seq())}, ""
		}},
	"POST /v1/types/{type}/resume": {orgless: true, answers: map[string]any{"paused": false},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			typ := fmt.Sprintf("auth.paused-%d", w.seq())
			w.asAdmin(t, http.MethodPost, "/v1/types/"+typ+"/pause", "")
			return map[string]string{"type": typ}, ""
		}},

	// Reads use the world's workflow and its run; org B has neither. Every
	// action on a run gets a fresh run of org A.
	"GET /v1/workflows": {sees: func(w *authWorld) []string { return []string{w.workflowID} }},
	"GET /v1/workflows/{name}": {sees: func(w *authWorld) []string { return []string{w.workflowID} },
		prepare: func(*testing.T, *authWorld) (map[string]string, string) {
			return map[string]string{"name": authWorkflow}, ""
		}},
	// Runs are listed by the workflow's name, which outlives the workflow
	// (a deleted workflow's runs stay listed under it): a name org B lacks
	// lists none of org A's runs rather than a 404.
	"GET /v1/workflows/{name}/runs": {orgless: true, sees: func(w *authWorld) []string { return []string{w.runID} },
		foreign: func(w *authWorld) []foreignQuery { return []foreignQuery{foreignAfter(w.runID)} },
		prepare: func(*testing.T, *authWorld) (map[string]string, string) {
			return map[string]string{"name": authWorkflow}, ""
		}},
	"POST /v1/workflows/{name}/runs": {answers: map[string]any{"status": "RUNNING", "workflow": authWorkflow},
		prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
			return map[string]string{"name": authWorkflow}, fmt.Sprintf(`{"params":{"n":%d}}`, w.seq())
		}},
	"GET /v1/runs": {sees: func(w *authWorld) []string { return []string{w.runID} },
		foreign: func(w *authWorld) []foreignQuery { return []foreignQuery{foreignAfter(w.runID)} }},
	"GET /v1/runs/{id}": {sees: func(w *authWorld) []string { return []string{w.runTask} },
		prepare: func(_ *testing.T, w *authWorld) (map[string]string, string) {
			return map[string]string{"id": w.runID}, ""
		}},
	"POST /v1/runs/{id}/cancel": {answers: map[string]any{"status": "CANCELLED"},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			id, _ := w.newRun(t)
			return map[string]string{"id": id}, ""
		}},
	"POST /v1/runs/{id}/retry": {answers: map[string]any{"status": "RUNNING"},
		prepare: func(t *testing.T, w *authWorld) (map[string]string, string) {
			id, _ := w.newRun(t)
			w.asAdmin(t, http.MethodPost, "/v1/runs/"+id+"/cancel", "")
			return map[string]string{"id": id}, ""
		}},
	"GET /v1/lineage": {query: "?dataset=" + authDataset, answers: map[string]any{"dataset": authDataset},
		sees: func(*authWorld) []string { return []string{`"workflow":"` + authWorkflow + `"`} }},
}

// Revocation reaches every instance within a second: two APIs on one
// database both refuse a key revoked through one of them.
func TestRevokedKeyIsRefusedByEveryInstanceWithinASecond(t *testing.T) {
	t.Parallel()
	var cfg config.API
	one := setup(t, capture(&cfg))
	two := one.another(t, cfg, io.Discard)

	key := one.post(t, "/v1/keys", `{"name":"short-lived","role":"reader"}`)
	require.Equal(t, http.StatusCreated, key.status, string(key.body))
	id, secret := key.json(t)["id"].(string), key.json(t)["secret"].(string)
	for _, api := range []*testBundle{one, two} {
		require.Equal(t, http.StatusOK, api.do(t, http.MethodGet, "/v1/whoami", "", "", "Authorization", "Bearer "+secret).status,
			"the key works, and each instance has it cached")
	}

	require.Equal(t, http.StatusOK, one.do(t, http.MethodDelete, "/v1/keys/"+id, "", "").status)
	revoked := time.Now()
	var wg sync.WaitGroup
	took := make([]time.Duration, 2)
	for i, api := range []*testBundle{one, two} {
		wg.Go(func() {
			for time.Since(revoked) < 3*time.Second {
				if api.probe("/v1/whoami", "Bearer "+secret) == http.StatusUnauthorized {
					took[i] = time.Since(revoked)
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			took[i] = time.Hour
		})
	}
	wg.Wait()
	t.Logf("refused %s and %s after the revocation (AUTH_CACHE_TTL %s)", took[0], took[1], cfg.AuthCacheTTL)
	for i, d := range took {
		require.LessOrEqual(t, d, time.Second, "instance %d still took the revoked key %s after its revocation", i+1, d)
	}
	for _, api := range []*testBundle{one, two} {
		resp := api.do(t, http.MethodGet, "/v1/whoami", "", "", "Authorization", "Bearer "+secret)
		require.Equal(t, http.StatusUnauthorized, resp.status, "and keeps refusing it")
		require.Contains(t, resp.json(t)["detail"], "revoked")
	}
}

// Revoking a key answers the key as it now stands: revoked, with the time
// of its revocation (openapi.yaml: "The key, revoked_at set"), the same as
// the listing shows right after.
func TestRevokeAnswersTheKeyRevoked(t *testing.T) {
	t.Parallel()
	b := setup(t)
	key := b.post(t, "/v1/keys", `{"name":"to-revoke","role":"reader"}`)
	require.Equal(t, http.StatusCreated, key.status, string(key.body))
	id := key.json(t)["id"].(string)

	revoked := b.do(t, http.MethodDelete, "/v1/keys/"+id, "", "")
	require.Equal(t, http.StatusOK, revoked.status, string(revoked.body))
	at, ok := revoked.json(t)["revoked_at"].(string)
	require.True(t, ok, "the first revocation's answer has no revoked_at: %s", revoked.body)

	var listed struct {
		Keys []struct {
			ID        string `json:"id"`
			RevokedAt string `json:"revoked_at"`
		} `json:"keys"`
	}
	require.NoError(t, json.Unmarshal(b.get(t, "/v1/keys").body, &listed))
	for _, k := range listed.Keys {
		if k.ID == id {
			require.Equal(t, k.RevokedAt, at, "the answer and the listing agree")
		}
	}
	again := b.do(t, http.MethodDelete, "/v1/keys/"+id, "", "")
	require.Equal(t, http.StatusOK, again.status, string(again.body))
	require.Equal(t, at, again.json(t)["revoked_at"], "revoking a revoked key changes nothing")
}

// No cache may keep an answer of the API: the dashboard's requests carry a
// cookie, not an Authorization header, and a shared cache stores answers
// to those unless told otherwise.
func TestAnswersAreNotStoredByCaches(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, path := range []string{"/v1/tasks", "/v1/overview", "/v1/whoami", "/v1/tasks/0190a4b2-0000-7000-8000-000000000009"} {
		resp := b.get(t, path)
		require.Equal(t, "no-store", resp.header.Get("Cache-Control"), "%s answered %d", path, resp.status)
	}
	refused := b.do(t, http.MethodGet, "/v1/tasks", "", "", "Authorization", "Bearer cvk_nope")
	require.Equal(t, http.StatusUnauthorized, refused.status)
	require.Equal(t, "no-store", refused.header.Get("Cache-Control"))
}

// The rate limit is per principal: past its burst a caller gets 429 with
// Retry-After, others go on, and it may call again after that wait.
func TestRateLimitAnswers429WithRetryAfter(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.RateLimit, c.RateBurst = 1, 2 })
	other, _ := b.db.Key(t, "test", auth.Reader)

	for range 2 {
		require.Equal(t, http.StatusOK, b.get(t, "/v1/whoami").status, "within the burst")
	}
	limited := b.get(t, "/v1/whoami")
	require.Equal(t, http.StatusTooManyRequests, limited.status, string(limited.body))
	require.Equal(t, "application/problem+json", limited.header.Get("Content-Type"))
	require.EqualValues(t, http.StatusTooManyRequests, limited.json(t)["status"])
	wait, err := strconv.Atoi(limited.header.Get("Retry-After"))
	require.NoError(t, err, "Retry-After is whole seconds: %q", limited.header.Get("Retry-After"))
	require.Equal(t, 1, wait, "at 1 request a second, the next is at most a second away")

	require.Equal(t, http.StatusOK, b.do(t, http.MethodGet, "/v1/whoami", "", "", "Authorization", "Bearer "+other).status,
		"another key has its own budget")
	require.Equal(t, "1", metricValue(string(b.get(t, "/metrics").body), "conveyor_rate_limited_total"))

	time.Sleep(time.Duration(wait) * time.Second)
	require.Equal(t, http.StatusOK, b.get(t, "/v1/whoami").status, "after Retry-After")
}

// The dashboard's sign-in spends the key's rate limit as its requests do:
// past the burst it is a 429 with Retry-After, not a way to check a key
// (or to load the database) as fast as the form can be posted.
func TestDashboardSignInKeepsToTheRateLimit(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.RateLimit, c.RateBurst = 0.01, 2 })
	signIn := func() response {
		return b.do(t, http.MethodPost, "/ui/session", "application/json", `{"key":"`+b.token+`"}`,
			"Authorization", "", httpapi.UIHeader, "1")
	}
	for range 2 {
		require.Equal(t, http.StatusOK, signIn().status, "within the burst")
	}
	limited := signIn()
	require.Equal(t, http.StatusTooManyRequests, limited.status, string(limited.body))
	require.NotEmpty(t, limited.header.Get("Retry-After"))
	require.Empty(t, limited.header.Get("Set-Cookie"), "no session past the limit")
	require.Equal(t, http.StatusTooManyRequests, b.get(t, "/v1/whoami").status, "one budget for the key")
}

// A task's events name who acted: the key that submitted it, the user who
// cancelled it, the key that retried it.
func TestEventsNameTheKeyOrUserWhoActed(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	b := setup(t, withOIDC(iss))
	writerKey, writer := b.db.Key(t, "test", auth.Writer)
	user := b.post(t, "/v1/users", `{"external_id":"carol","email":"carol@example.com","role":"writer"}`)
	require.Equal(t, http.StatusCreated, user.status, string(user.body))
	carol := user.json(t)["id"].(string)
	me := b.get(t, "/v1/whoami").json(t) // the admin key b sends

	submitted := b.do(t, http.MethodPost, "/v1/tasks", "application/json", `{"type":"demo.sleep"}`, "Authorization", "Bearer "+writerKey)
	require.Equal(t, http.StatusCreated, submitted.status, string(submitted.body))
	id := submitted.json(t)["id"].(string)
	cancelled := b.do(t, http.MethodPost, "/v1/tasks/"+id+"/cancel", "", "",
		"Authorization", "Bearer "+iss.Token(t, map[string]any{"sub": "carol", "aud": oidcAudience}))
	require.Equal(t, http.StatusOK, cancelled.status, string(cancelled.body))
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+id+"/retry", "").status)

	resp := b.get(t, "/v1/tasks/"+id+"/events")
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	var got struct {
		Events []struct {
			Status string
			By     map[string]any
		}
	}
	require.NoError(t, json.Unmarshal(resp.body, &got))
	require.Len(t, got.Events, 3)
	want := []struct {
		status string
		by     map[string]any
	}{
		{"PENDING", map[string]any{"kind": "key", "id": me["id"], "name": me["name"]}},
		{"CANCELLED", map[string]any{"kind": "user", "id": carol, "name": "carol@example.com"}},
		{"PENDING", map[string]any{"kind": "key", "id": writer.ID.String(), "name": writer.Name}},
	}
	for i, e := range got.Events {
		require.Equal(t, want[i].status, e.Status, "event %d, newest first", i)
		require.Equal(t, want[i].by, e.By, "event %d (%s)", i, e.Status)
	}
}

// An Idempotency-Key bound to a task the caller may not see is a key used
// with another request (the caller cannot send the same one: it may not
// restrict a task to roles it lacks): a 422 that does not reveal the task.
func TestIdempotencyKeyOfATaskTheCallerCannotSee(t *testing.T) {
	t.Parallel()
	b := setup(t)
	outsider, _ := b.db.Key(t, "test", auth.Writer)
	require.Equal(t, http.StatusCreated, b.post(t, "/v1/roles", `{"slug":"`+seers+`"}`).status)
	hidden := b.post(t, "/v1/tasks", `{"type":"demo.noop","visibility":["`+seers+`"]}`, "Idempotency-Key", "order-7")
	require.Equal(t, http.StatusCreated, hidden.status, string(hidden.body))
	id := hidden.json(t)["id"].(string)

	for _, c := range []struct{ path, body, key string }{
		{"/v1/tasks", `{"type":"demo.noop"}`, "order-7"},
		{"/v1/tasks/batch", `{"tasks":[{"type":"demo.noop","idempotency_key":"order-7"}]}`, ""},
	} {
		resp := b.do(t, http.MethodPost, c.path, "application/json", c.body, "Idempotency-Key", c.key, "Authorization", "Bearer "+outsider)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", c.path, resp.body)
		requireAbsent(t, string(resp.body), id, "%s reveals the task the caller may not see", c.path)
	}
}

// Every refused credential is counted by its reason, and no credential,
// refused or accepted, reaches the log.
func TestAuthFailuresAreCountedAndCredentialsNeverLogged(t *testing.T) {
	t.Parallel()
	iss, stranger := testenv.NewIssuer(t), testenv.NewIssuer(t)
	var cfg config.API
	first := setup(t, withOIDC(iss), capture(&cfg))
	var logs testenv.SyncBuffer
	cfg.LogLevel = "debug"
	b := first.another(t, cfg, &logs)

	user := b.post(t, "/v1/users", `{"external_id":"dave","role":"reader"}`)
	require.Equal(t, http.StatusCreated, user.status, string(user.body))
	revoked := b.post(t, "/v1/keys", `{"name":"revoked","role":"reader"}`).json(t)
	require.Equal(t, http.StatusOK, b.do(t, http.MethodDelete, "/v1/keys/"+revoked["id"].(string), "", "").status)
	expiresAt := time.Now().Add(300 * time.Millisecond)
	expiring := b.post(t, "/v1/keys", fmt.Sprintf(`{"name":"expiring","role":"reader","expires_at":%q}`,
		expiresAt.UTC().Format(time.RFC3339Nano))).json(t)
	time.Sleep(time.Until(expiresAt) + 50*time.Millisecond)

	valid := b.token
	validJWT := iss.Token(t, map[string]any{"sub": "dave", "aud": oidcAudience})
	attempts := []struct {
		header, reason string
	}{
		{"", auth.ReasonMissing},
		{"Basic ZGF2ZTpodW50ZXIy", auth.ReasonMalformed},
		{"Bearer not-a-token-Zq8wX3", auth.ReasonMalformed},
		{"Bearer cvk_short_Zq8wX3", auth.ReasonMalformed},
		// Not text PostgreSQL takes: refused as malformed, not a failed lookup (503).
		{"Bearer cvk_" + strings.Repeat("\xff", 16) + "_" + strings.Repeat("a", 52), auth.ReasonMalformed},
		{"Bearer " + unknownKey(), auth.ReasonUnknownKey},
		{"Bearer " + wrongSecret(valid), auth.ReasonUnknownKey},
		{"Bearer " + revoked["secret"].(string), auth.ReasonRevoked},
		{"Bearer " + expiring["secret"].(string), auth.ReasonExpired},
		{"Bearer " + iss.Token(t, map[string]any{"sub": "dave", "aud": oidcAudience, "exp": time.Now().Add(-time.Minute)}), auth.ReasonInvalidJWT},
		{"Bearer " + stranger.Token(t, map[string]any{"sub": "dave", "aud": oidcAudience}), auth.ReasonInvalidJWT},
		{"Bearer " + iss.Token(t, map[string]any{"sub": "nobody", "aud": oidcAudience}), auth.ReasonUnknownUser},
		// A subject PostgreSQL cannot hold as text is no user's either:
		// not a failed lookup (503).
		{"Bearer " + iss.Token(t, map[string]any{"sub": "no\x00body", "aud": oidcAudience}), auth.ReasonUnknownUser},
	}
	want := map[string]int{}
	for _, a := range attempts {
		resp := b.do(t, http.MethodGet, "/v1/tasks", "", "", "Authorization", a.header)
		require.Equal(t, http.StatusUnauthorized, resp.status, "%s: %s", a.reason, resp.body)
		want[a.reason]++
	}
	require.Equal(t, http.StatusOK, b.do(t, http.MethodGet, "/v1/tasks", "", "", "Authorization", "Bearer "+validJWT).status)

	metrics := string(b.get(t, "/metrics").body)
	for reason, n := range want {
		series := fmt.Sprintf("conveyor_auth_failures_total{reason=%q}", reason)
		require.Equal(t, strconv.Itoa(n), metricValue(metrics, series), series)
	}

	logged := logs.String()
	for reason := range want {
		require.Contains(t, logged, fmt.Sprintf(`"reason":%q`, reason), "the refusal is logged")
	}
	for _, a := range append(attempts, struct{ header, reason string }{"Bearer " + valid, "a valid key"},
		struct{ header, reason string }{"Bearer " + validJWT, "a valid JWT"}) {
		for _, secret := range secretsOf(a.header) {
			requireAbsent(t, logged, secret, "a credential (%s) is in the log", a.reason)
		}
	}
}

// --- The world of TestEveryOperationAdmitsOnlyItsCallers ---

// authWorld is a running API with OpenID Connect, its org A ("test") and
// org B ("other"), and callers of every kind.
type authWorld struct {
	*testBundle
	iss *testenv.Issuer

	orgA    string
	seersID string
	// keys and users hold each role and the org role seers; outsiders
	// hold each role and no org role.
	keys, users, outsiderKeys, outsiderUsers map[auth.Role]caller
	// demoted was an admin, and is a reader now.
	demoted caller
	// subs are the subjects of the users.
	subs   map[auth.Role]string
	adminB caller
	// refused are credentials every authenticated operation answers 401.
	refused []caller

	openTask, restrictedTask string
	// jobID is org A's job of the jobs file the world starts with, which
	// also limits limitedType and declares workflowID (authWorkflow).
	jobID, workflowID string
	// runID is a run of authWorkflow, and runTask its first node's task.
	runID, runTask           string
	keyIDs, userIDs, seerIDs []string
	// orgAIDs are the ids of org A and its resources: none may show in an
	// answer to org B.
	orgAIDs []string

	n atomic.Int64
}

// caller is a credential: the value of an Authorization header.
type caller struct {
	name, header string
	// mention is a part of the detail of the 401 it gets, if refused.
	mention string
}

func newAuthWorld(t *testing.T) *authWorld {
	t.Helper()
	iss := testenv.NewIssuer(t)
	b := setup(t, withOIDC(iss), func(c *config.API) { c.AuthCacheTTL = authTTL })
	w := &authWorld{testBundle: b, iss: iss, keys: map[auth.Role]caller{}, users: map[auth.Role]caller{},
		outsiderKeys: map[auth.Role]caller{}, outsiderUsers: map[auth.Role]caller{}, subs: map[auth.Role]string{}}

	w.orgA = w.asAdmin(t, http.MethodGet, "/v1/whoami", "")["org_id"].(string)
	w.seersID = w.asAdmin(t, http.MethodPost, "/v1/roles", `{"slug":"`+seers+`","name":"Seers"}`)["id"].(string)
	tokenB, _ := b.db.Key(t, "other", auth.Admin)
	w.adminB = caller{name: "admin of org B", header: "Bearer " + tokenB}

	for _, role := range roles {
		token, p := b.db.Key(t, "test", role, seers)
		w.keys[role] = caller{name: string(role) + " key", header: "Bearer " + token}
		w.keyIDs = append(w.keyIDs, p.ID.String())
		token, p = b.db.Key(t, "test", role)
		w.outsiderKeys[role] = caller{name: string(role) + " key outside " + seers, header: "Bearer " + token}
		w.keyIDs = append(w.keyIDs, p.ID.String())

		id, sub := w.newUser(t, role)
		w.asAdmin(t, http.MethodPut, "/v1/roles/"+seers+"/members/"+id, "")
		w.users[role] = caller{name: string(role) + " user", header: "Bearer " + w.jwt(t, sub)}
		w.subs[role] = sub
		w.userIDs, w.seerIDs = append(w.userIDs, id), append(w.seerIDs, id)
		id, sub = w.newUser(t, role)
		w.outsiderUsers[role] = caller{name: string(role) + " user outside " + seers, header: "Bearer " + w.jwt(t, sub)}
		w.userIDs = append(w.userIDs, id)
	}
	w.openTask, w.restrictedTask = w.newTask(t, false), w.newTask(t, true)
	w.asAdmin(t, http.MethodPost, "/v1/jobs/apply", fmt.Sprintf(`{"jobs":[{"name":"auth-fixture","type":"auth.job"}],
		"types":[{"type":%q,"max_concurrency":3}],
		"workflows":[{"name":%q,"nodes":[{"name":"make","job":"auth-fixture","output_datasets":[%q]},
			{"name":"use","job":"auth-fixture","depends_on":["make"],"input_datasets":[%q]}]}]}`,
		limitedType, authWorkflow, authDataset, authDataset))
	w.jobID = w.asAdmin(t, http.MethodGet, "/v1/jobs/auth-fixture", "")["id"].(string)
	w.workflowID = w.asAdmin(t, http.MethodGet, "/v1/workflows/"+authWorkflow, "")["id"].(string)
	w.runID, w.runTask = w.newRun(t)
	w.orgAIDs = slices.Concat([]string{w.orgA, w.seersID, w.openTask, w.restrictedTask, w.jobID, limitedType,
		w.workflowID, w.runID, w.runTask, authWorkflow}, w.keyIDs, w.userIDs)
	w.refused = w.refusedCallers(t)
	return w
}

// refusedCallers are credentials that would be an admin of org A were they
// valid. It also makes w.demoted, a user who was an admin. The revoked key,
// the deleted user and the demoted one are used before they change, so
// that the API has them cached.
func (w *authWorld) refusedCallers(t *testing.T) []caller {
	t.Helper()
	admin := w.subs[auth.Admin]
	other := testenv.NewIssuer(t)
	claims := func(extra ...any) map[string]any {
		c := map[string]any{"sub": admin, "aud": oidcAudience}
		for i := 0; i+1 < len(extra); i += 2 {
			c[extra[i].(string)] = extra[i+1]
		}
		return c
	}
	now := time.Now()

	revoked := w.asAdmin(t, http.MethodPost, "/v1/keys", `{"name":"soon-revoked","role":"admin"}`)
	gone, goneSub := w.newUser(t, auth.Admin)
	demoted, demotedSub := w.newUser(t, auth.Admin)
	w.demoted = caller{name: "an admin demoted to reader", header: "Bearer " + w.jwt(t, demotedSub)}
	for _, c := range []string{"Bearer " + revoked["secret"].(string), "Bearer " + w.jwt(t, goneSub), w.demoted.header} {
		require.Equal(t, http.StatusOK, w.do(t, http.MethodGet, "/v1/keys", "", "", "Authorization", c).status)
	}
	w.asAdmin(t, http.MethodDelete, "/v1/keys/"+revoked["id"].(string), "")
	w.asAdmin(t, http.MethodDelete, "/v1/users/"+gone, "")
	w.asAdmin(t, http.MethodPatch, "/v1/users/"+demoted, `{"role":"reader"}`)
	changedAt := time.Now()
	expiresAt := time.Now().Add(300 * time.Millisecond)
	expiring := w.asAdmin(t, http.MethodPost, "/v1/keys", fmt.Sprintf(`{"name":"soon-expired","role":"admin","expires_at":%q}`,
		expiresAt.UTC().Format(time.RFC3339Nano)))
	w.orgAIDs = append(w.orgAIDs, revoked["id"].(string), expiring["id"].(string), gone, demoted)

	refused := []caller{
		{name: "no Authorization header"},
		{name: "Basic credentials", header: "Basic YWRtaW46YWRtaW4="},
		{name: "Bearer without a token", header: "Bearer"},
		{name: "a token of no known form", header: "Bearer nonsense"},
		{name: "an API key of the wrong shape", header: "Bearer cvk_short_secret"},
		{name: "an API key nobody has", header: "Bearer " + unknownKey()},
		{name: "an admin key's prefix with another secret", header: "Bearer " + wrongSecret(strings.TrimPrefix(w.keys[auth.Admin].header, "Bearer "))},
		{name: "a JWT that is not one", header: "Bearer a.b.c"},
		{name: "an unsigned JWT", header: "Bearer " + unsignedJWT(claims("iss", w.iss.URL, "exp", now.Add(time.Hour).Unix()))},
		{name: "an expired JWT", header: "Bearer " + w.iss.Token(t, claims("iat", now.Add(-2*time.Hour), "exp", now.Add(-time.Minute)))},
		{name: "a JWT not yet valid", header: "Bearer " + w.iss.Token(t, claims("nbf", now.Add(time.Hour)))},
		{name: "a JWT of another issuer", header: "Bearer " + other.Token(t, claims())},
		{name: "a JWT claiming the issuer, signed by another", header: "Bearer " + other.Token(t, claims("iss", w.iss.URL))},
		{name: "a JWT signed by the issuer, naming another", header: "Bearer " + w.iss.Token(t, claims("iss", other.URL))},
		{name: "a JWT for another audience", header: "Bearer " + w.iss.Token(t, claims("aud", "someone-else"))},
		{name: "a JWT of no user", header: "Bearer " + w.iss.Token(t, claims("sub", "nobody-at-all"))},
		{name: "a revoked key", header: "Bearer " + revoked["secret"].(string), mention: "revoked"},
		{name: "an expired key", header: "Bearer " + expiring["secret"].(string), mention: "expired"},
		{name: "a deleted user's JWT", header: "Bearer " + w.jwt(t, goneSub), mention: "no user"},
	}
	// What changed may still be cached for up to authTTL, and the other
	// key works until it expires.
	time.Sleep(max(time.Until(expiresAt), authTTL-time.Since(changedAt)) + 50*time.Millisecond)
	return refused
}

// apiCall is one request to an operation.
type apiCall struct {
	method, path, body string
	// contentType is the body's; "" for JSON.
	contentType string
	// names are the path parameters: ids of org A's resources.
	names []string
}

// prepare fills op's path and body for org A, as how says.
func (w *authWorld) prepare(t *testing.T, op specOp, how opSpec) apiCall {
	t.Helper()
	c := apiCall{method: op.method, path: op.path, contentType: how.contentType}
	if how.prepare != nil {
		var params map[string]string
		params, c.body = how.prepare(t, w)
		for name, value := range params {
			require.Contains(t, c.path, "{"+name+"}", "authOps fills %s, which %s lacks", name, op.name())
			c.path = strings.ReplaceAll(c.path, "{"+name+"}", value)
			c.names = append(c.names, value)
		}
	}
	require.NotContains(t, c.path, "{", "authOps does not fill every parameter of %s", op.name())
	c.path += how.query
	return c
}

func (w *authWorld) send(t *testing.T, c apiCall, authorization string) response {
	t.Helper()
	contentType := c.contentType
	if c.body != "" && contentType == "" {
		contentType = "application/json"
	}
	return w.do(t, c.method, c.path, contentType, c.body, "Authorization", authorization)
}

// asAdmin calls the API as org A's admin and returns the JSON answer (nil
// for none); anything but 2xx fails the test.
func (w *authWorld) asAdmin(t *testing.T, method, path, body string) map[string]any {
	t.Helper()
	contentType := ""
	if body != "" {
		contentType = "application/json"
	}
	resp := w.do(t, method, path, contentType, body)
	require.True(t, resp.status >= 200 && resp.status < 300, "%s %s: %d %s", method, path, resp.status, resp.body)
	if len(resp.body) == 0 {
		return nil
	}
	return resp.json(t)
}

func (w *authWorld) seq() int64 { return w.n.Add(1) }

// newTaskOf submits a task of the type to org A, restricted to seers.
func (w *authWorld) newTaskOf(t *testing.T, typ string) string {
	t.Helper()
	return w.asAdmin(t, http.MethodPost, "/v1/tasks", fmt.Sprintf(`{"type":%q,"visibility":[%q]}`, typ, seers))["id"].(string)
}

// newTask submits a task to org A, restricted to seers or open to all.
func (w *authWorld) newTask(t *testing.T, restricted bool) string {
	t.Helper()
	vis := "[]"
	if restricted {
		vis = `["` + seers + `"]`
	}
	return w.asAdmin(t, http.MethodPost, "/v1/tasks", fmt.Sprintf(`{"type":"auth.fixture","payload":{"n":%d},"visibility":%s}`, w.seq(), vis))["id"].(string)
}

// limitedType is the task type the world's jobs file limits in org A.
const limitedType = "auth.limited"

// authWorkflow is org A's workflow of the world's jobs file: a node that
// writes authDataset, then one that reads it.
const (
	authWorkflow = "auth-workflow"
	authDataset  = "auth.dataset"
)

// newRun starts a run of authWorkflow in org A and returns its id and the
// task of its first node.
func (w *authWorld) newRun(t *testing.T) (string, string) {
	t.Helper()
	run := w.asAdmin(t, http.MethodPost, "/v1/workflows/"+authWorkflow+"/runs", fmt.Sprintf(`{"params":{"n":%d}}`, w.seq()))
	first := run["nodes"].([]any)[0].(map[string]any)
	return run["id"].(string), first["task_id"].(string)
}

// jobFile is a jobs file, in YAML, of one job.
func jobFile(name string) string {
	return "jobs:\n  - name: " + name + "\n    type: auth.job\n    payload: {from: " + name + "}\n"
}

// newJob applies a jobs file of one fresh job to org A, leaving the other
// jobs alone, and returns its name.
func (w *authWorld) newJob(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("auth-job-%d", w.seq())
	resp := w.do(t, http.MethodPost, "/v1/jobs/apply", "application/yaml", jobFile(name))
	require.Equal(t, http.StatusOK, resp.status, string(resp.body))
	return name
}

func (w *authWorld) newKey(t *testing.T) string {
	t.Helper()
	return w.asAdmin(t, http.MethodPost, "/v1/keys", fmt.Sprintf(`{"name":"fresh-%d","role":"reader"}`, w.seq()))["id"].(string)
}

// newUser adds a user of the role to org A and returns its id and subject.
func (w *authWorld) newUser(t *testing.T, role auth.Role) (string, string) {
	t.Helper()
	sub := fmt.Sprintf("%s-%d", role, w.seq())
	u := w.asAdmin(t, http.MethodPost, "/v1/users", fmt.Sprintf(`{"external_id":%q,"email":"%s@example.com","role":%q}`, sub, sub, role))
	return u["id"].(string), sub
}

// newRole defines a role in org A and, with twin, one of the same slug in
// org B.
func (w *authWorld) newRole(t *testing.T, twin bool) string {
	t.Helper()
	slug := fmt.Sprintf("role-%d", w.seq())
	w.asAdmin(t, http.MethodPost, "/v1/roles", `{"slug":"`+slug+`"}`)
	if twin {
		resp := w.do(t, http.MethodPost, "/v1/roles", "application/json", `{"slug":"`+slug+`"}`, "Authorization", w.adminB.header)
		require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
	}
	return slug
}

func (w *authWorld) jwt(t *testing.T, sub string) string {
	t.Helper()
	return w.iss.Token(t, map[string]any{"sub": sub, "aud": oidcAudience})
}

// --- openapi.yaml ---

// specOp is an operation of openapi.yaml.
type specOp struct {
	method, path string
	public       bool // security: []
	role         string
	responses    map[string]any
}

func (op specOp) name() string { return op.method + " " + op.path }

func specOperations(t *testing.T) []specOp {
	t.Helper()
	raw, err := os.ReadFile(specFile)
	require.NoError(t, err)
	var doc struct {
		Paths map[string]map[string]yaml.Node `yaml:"paths"`
	}
	require.NoError(t, yaml.Unmarshal(raw, &doc))
	var ops []specOp
	for path, methods := range doc.Paths {
		for method, node := range methods {
			if method == "parameters" {
				continue
			}
			var op struct {
				Security     *[]any         `yaml:"security"`
				RequiredRole string         `yaml:"x-required-role"`
				Responses    map[string]any `yaml:"responses"`
			}
			require.NoError(t, node.Decode(&op), "%s %s", method, path)
			ops = append(ops, specOp{method: strings.ToUpper(method), path: path,
				public: op.Security != nil && len(*op.Security) == 0, role: op.RequiredRole, responses: op.Responses})
		}
	}
	sort.Slice(ops, func(i, j int) bool { return ops[i].name() < ops[j].name() })
	return ops
}

// --- Starting APIs and credentials ---

func withOIDC(iss *testenv.Issuer) func(*config.API) {
	return func(c *config.API) { c.OIDCIssuerURL, c.OIDCAudience = iss.URL, oidcAudience }
}

// capture copies the configuration setup ends with into dst (pass it
// last).
func capture(dst *config.API) func(*config.API) {
	return func(c *config.API) { *dst = *c }
}

// another starts one more API on b's database with cfg (on a port of its
// own) and its log written to logs; it stops when t ends.
func (b *testBundle) another(t *testing.T, cfg config.API, logs io.Writer) *testBundle {
	t.Helper()
	cfg.Addr = testenv.FreeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- run(ctx, cfg, logs) }()
	two := &testBundle{db: b.db, base: "http://" + cfg.Addr, client: &http.Client{Timeout: 10 * time.Second}, token: b.token}
	t.Cleanup(func() {
		two.client.CloseIdleConnections()
		cancel()
		require.NoError(t, <-errc)
	})
	testenv.WaitHTTP(t, two.base+"/readyz", 10*time.Second)
	return two
}

// probe GETs path with the Authorization header and returns the status, or
// 0 if the request failed: for goroutines, which must not fail the test.
func (b *testBundle) probe(path, authorization string) int {
	req, err := http.NewRequest(http.MethodGet, b.base+path, nil)
	if err != nil {
		return 0
	}
	req.Header.Set("Authorization", authorization)
	resp, err := b.client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode
}

// unknownKey has the form of an API key, but no org has it.
func unknownKey() string {
	return "cvk_" + strings.Repeat("a", 16) + "_" + strings.Repeat("a", 52)
}

// wrongSecret is key's prefix with another secret.
func wrongSecret(key string) string {
	prefix, ok := auth.KeyPrefix(key)
	if !ok {
		panic("not a key: " + key)
	}
	return prefix + "_" + strings.Repeat("b", 52)
}

// unsignedJWT is a JWT with "alg": "none" and no signature.
func unsignedJWT(claims map[string]any) string {
	enc := func(v any) string {
		b, _ := json.Marshal(v)
		return base64.RawURLEncoding.EncodeToString(b)
	}
	return enc(map[string]string{"alg": "none", "typ": "JWT"}) + "." + enc(claims) + "."
}

// secretsOf returns the parts of an Authorization header that must never be
// logged: the token, and its secret part (an API key's after its prefix, a
// JWT's signature).
func secretsOf(header string) []string {
	_, token, _ := strings.Cut(header, " ")
	if token == "" {
		return nil
	}
	out := []string{token}
	if prefix, ok := auth.KeyPrefix(token); ok {
		out = append(out, strings.TrimPrefix(token, prefix+"_"))
	}
	if parts := strings.Split(token, "."); len(parts) == 3 && parts[2] != "" {
		out = append(out, parts[2])
	}
	return out
}

// requireAbsent fails if text holds s, showing the line that does rather
// than all of text.
func requireAbsent(t *testing.T, text, s string, msgAndArgs ...any) {
	t.Helper()
	i := strings.Index(text, s)
	if i < 0 {
		return
	}
	start := strings.LastIndexByte(text[:i], '\n') + 1
	end := len(text)
	if j := strings.IndexByte(text[i:], '\n'); j >= 0 {
		end = i + j
	}
	line := text[start:end]
	if len(line) > 2000 {
		line = line[:2000] + "…"
	}
	require.Fail(t, fmt.Sprintf("found %q in: %s", s, line), msgAndArgs...)
}

// metricValue returns the value of a series in a Prometheus exposition, or
// "" if it has none.
func metricValue(exposition, series string) string {
	for line := range strings.Lines(exposition) {
		if value, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			return value
		}
	}
	return ""
}

// Every operation of openapi.yaml refuses a query parameter it does not
// document with a 400, before anything else: a misspelt filter is never
// silently ignored. (The parameters each documents are exercised by the
// tests of its operation.)
func TestEveryOperationRefusesAnUnknownQueryParameter(t *testing.T) {
	t.Parallel()
	b := setup(t)
	fill := strings.NewReplacer("{id}", "01900000-0000-7000-8000-000000000000",
		"{user_id}", "01900000-0000-7000-8000-000000000000", "{name}", "x", "{type}", "x", "{slug}", "x")
	for _, op := range specOperations(t) {
		resp := b.do(t, op.method, fill.Replace(op.path)+"?limt=10", "", "")
		require.Equal(t, http.StatusBadRequest, resp.status, "%s: %s", op.name(), resp.body)
		require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"), op.name())
		require.Contains(t, resp.json(t)["detail"], `unknown query parameter "limt"`, op.name())
	}
}

// Made-up API keys from one address are looked up only for its burst of
// failures; then the address gets 429 with Retry-After, the made-up
// prefixes never reaching the database, while the key it used before
// still gets in.
func TestFailedAuthenticationsOfOneAddressAreBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.AuthFailureLimit, c.AuthFailureBurst = 0.001, 2 })
	require.Equal(t, http.StatusOK, b.get(t, "/v1/whoami").status)

	for i := range 10 {
		r := b.do(t, http.MethodGet, "/v1/whoami", "", "", "Authorization", "Bearer "+auth.GenerateKey().Token)
		if i < 2 {
			require.Equal(t, http.StatusUnauthorized, r.status, string(r.body))
			continue
		}
		require.Equal(t, http.StatusTooManyRequests, r.status, string(r.body))
		require.Equal(t, "application/problem+json", r.header.Get("Content-Type"))
		wait, err := strconv.Atoi(r.header.Get("Retry-After"))
		require.NoError(t, err)
		require.Positive(t, wait)
	}
	require.Equal(t, http.StatusOK, b.get(t, "/v1/whoami").status, "a key found before is not refused")
	metrics := string(b.get(t, "/metrics").body)
	require.Equal(t, "2", metricValue(metrics, `conveyor_auth_failures_total{reason="unknown_key"}`), "only the burst was looked up")
	require.Equal(t, "8", metricValue(metrics, "conveyor_rate_limited_total"))
}
