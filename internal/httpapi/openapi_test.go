package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"
	"gopkg.in/yaml.v3"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// TestOpenAPIMatchesRoutes keeps openapi.yaml true: every route the router
// serves is documented with its method, and nothing else is.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	t.Parallel()
	var doc struct {
		OpenAPI string                    `yaml:"openapi"`
		Paths   map[string]map[string]any `yaml:"paths"`
	}
	require.NoError(t, yaml.Unmarshal(openAPI, &doc))
	require.True(t, strings.HasPrefix(doc.OpenAPI, "3.1"))
	var documented []string
	for path, ops := range doc.Paths {
		for method := range ops {
			if method == "parameters" {
				continue
			}
			documented = append(documented, strings.ToUpper(method)+" "+path)
		}
	}

	s := &server{Deps: Deps{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), TracerProvider: noop.NewTracerProvider(),
		Propagator: propagation.TraceContext{}, Registry: prometheus.NewRegistry()}}
	s.metrics = newMetrics(s.Registry)
	var served []string
	require.NoError(t, chi.Walk(s.router(), func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		if !strings.HasPrefix(route, "/ui") { // the dashboard's pages are not the API
			served = append(served, method+" "+route)
		}
		return nil
	}))
	sort.Strings(documented)
	sort.Strings(served)
	require.Equal(t, served, documented)
}

// TestOpenAPISecurity keeps the document's security true: every operation
// is public (security: []) or names in x-required-role the role the router
// enforces, found by calling the handler as a principal of each role.
func TestOpenAPISecurity(t *testing.T) {
	t.Parallel()
	var doc struct {
		Security   []map[string][]string `yaml:"security"`
		Components struct {
			SecuritySchemes map[string]struct {
				Type   string `yaml:"type"`
				Scheme string `yaml:"scheme"`
			} `yaml:"securitySchemes"`
		} `yaml:"components"`
	}
	require.NoError(t, yaml.Unmarshal(openAPI, &doc))
	require.Equal(t, []map[string][]string{{"bearer": {}}}, doc.Security, "every operation needs the bearer token unless it says security: []")
	require.Equal(t, "http", doc.Components.SecuritySchemes["bearer"].Type)
	require.Equal(t, "bearer", doc.Components.SecuritySchemes["bearer"].Scheme)

	ops := documentedOperations(t)
	require.NotEmpty(t, ops)
	handlers := map[auth.Role]http.Handler{}
	for _, role := range []auth.Role{"", auth.Reader, auth.Writer, auth.Admin} {
		handlers[role] = testHandler(DevMode(auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: role}))
	}
	refuseAll := testHandler(refusingAuthenticator{})

	for _, op := range ops {
		t.Run(op.Method+" "+op.Path, func(t *testing.T) {
			if op.Public {
				require.Empty(t, op.RequiredRole, "a public operation needs no role")
				require.False(t, strings.HasPrefix(op.Path, "/v1/"), "every /v1 route is authenticated")
				status, _ := callOperation(refuseAll, op)
				require.NotEqual(t, http.StatusUnauthorized, status, "a public operation must not ask for credentials")
				return
			}
			need, err := auth.ParseRole(op.RequiredRole)
			require.NoError(t, err, "x-required-role must be reader, writer or admin")

			// The documented refusals.
			require.Contains(t, op.Responses, "401")
			require.Contains(t, op.Responses, "429")
			if need != auth.Reader {
				require.Contains(t, op.Responses, "403", "a role can be too weak for it")
			}
			if strings.Contains(op.Path, "{") {
				require.Contains(t, op.Responses, "404", "its resource can be missing, or another org's")
			}

			// The enforced ones.
			status, _ := callOperation(refuseAll, op)
			require.Equal(t, http.StatusUnauthorized, status, "without credentials")
			var allowed []auth.Role
			for _, role := range []auth.Role{"", auth.Reader, auth.Writer, auth.Admin} {
				status, p := callOperation(handlers[role], op)
				if status != http.StatusForbidden {
					allowed = append(allowed, role)
					continue
				}
				require.Contains(t, p.Detail, "this needs the", "as %q: a 403 other than the role check's", role)
			}
			ladder := []auth.Role{auth.Reader, auth.Writer, auth.Admin}
			require.Equal(t, ladder[slices.Index(ladder, need):], allowed,
				"the router must let in exactly x-required-role and the roles above it")
		})
	}
}

// TestOpenAPIDocumentsTheCommonRefusals keeps the refusals that any
// operation can answer in each one's responses: a query parameter it does
// not take (400, as knownParams answers), a body of the wrong type (415) or
// over the limit (413) where it takes one, and, for every /v1 operation, a
// request that ran out of time or found the database down (503).
func TestOpenAPIDocumentsTheCommonRefusals(t *testing.T) {
	t.Parallel()
	h := testHandler(DevMode(auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Admin}))
	for _, op := range documentedOperations(t) {
		t.Run(op.Method+" "+op.Path, func(t *testing.T) {
			status, _ := callOperationWith(h, op, "not_a_parameter=1", "application/json", "{}")
			require.Equal(t, http.StatusBadRequest, status, "an unknown query parameter")
			require.Contains(t, op.Responses, "400", "an unknown query parameter is a 400")
			if strings.HasPrefix(op.Path, "/v1/") {
				require.Contains(t, op.Responses, "503", "a request that ran out of time, or found the database down")
			}
			if !op.Body {
				return
			}
			status, _ = callOperationWith(h, op, "", "text/plain", "{}")
			require.Equal(t, http.StatusUnsupportedMediaType, status, "a body of the wrong type")
			require.Contains(t, op.Responses, "415", "a body of the wrong type is a 415")
			status, _ = callOperationWith(h, op, "", "application/json", `{"x":"`+strings.Repeat("x", 1<<17)+`"}`)
			require.Equal(t, http.StatusRequestEntityTooLarge, status, "a body over the limit")
			require.Contains(t, op.Responses, "413", "a body over the limit is a 413")
		})
	}
}

// TestOpenAPIRefsResolve keeps the document whole: every local $ref names
// something it defines.
func TestOpenAPIRefsResolve(t *testing.T) {
	t.Parallel()
	var doc map[string]any
	require.NoError(t, yaml.Unmarshal(openAPI, &doc))
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if ref, ok := x.(string); k == "$ref" && ok {
					require.True(t, strings.HasPrefix(ref, "#/"), "only local refs: %s", ref)
					var at any = doc
					for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
						m, ok := at.(map[string]any)
						require.True(t, ok, "%s does not resolve", ref)
						at, ok = m[part]
						require.True(t, ok, "%s does not resolve", ref)
					}
					continue
				}
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		}
	}
	walk(doc)
}

// docOperation is what these tests read of one operation of openapi.yaml.
type docOperation struct {
	Method, Path string
	Public       bool // security: []
	RequiredRole string
	Responses    map[string]any
	Body         bool // it takes a request body
}

func documentedOperations(t *testing.T) []docOperation {
	t.Helper()
	var doc struct {
		Paths map[string]map[string]yaml.Node `yaml:"paths"`
	}
	require.NoError(t, yaml.Unmarshal(openAPI, &doc))
	var ops []docOperation
	for path, methods := range doc.Paths {
		for method, node := range methods {
			if method == "parameters" {
				continue
			}
			var op struct {
				Security     *[]map[string][]string `yaml:"security"`
				RequiredRole string                 `yaml:"x-required-role"`
				Responses    map[string]any         `yaml:"responses"`
				RequestBody  map[string]any         `yaml:"requestBody"`
			}
			require.NoError(t, node.Decode(&op), "%s %s", method, path)
			public := op.Security != nil
			if public {
				require.Empty(t, *op.Security, "%s %s: security is either [] or the document's", method, path)
			}
			ops = append(ops, docOperation{Method: strings.ToUpper(method), Path: path, Public: public,
				RequiredRole: op.RequiredRole, Responses: op.Responses, Body: op.RequestBody != nil})
		}
	}
	sort.Slice(ops, func(i, j int) bool { return ops[i].Path+ops[i].Method < ops[j].Path+ops[j].Method })
	return ops
}

// callOperation sends op to h with its path parameters filled and an empty
// JSON object as the body, and returns the status and the problem, if any.
func callOperation(h http.Handler, op docOperation) (int, problem) {
	return callOperationWith(h, op, "", "application/json", "{}")
}

// callOperationWith sends op to h with its path parameters filled, the
// query, and the body as its content type.
func callOperationWith(h http.Handler, op docOperation, query, contentType, body string) (int, problem) {
	path := strings.NewReplacer("{id}", uuid.NewString(), "{user_id}", uuid.NewString(), "{slug}", "ops").Replace(op.Path)
	if query != "" {
		path += "?" + query
	}
	req := httptest.NewRequest(op.Method, path, strings.NewReader(body))
	req.Header.Set("Content-Type", contentType)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	var p problem
	if strings.HasPrefix(rec.Header().Get("Content-Type"), "application/problem+json") {
		_ = json.Unmarshal(rec.Body.Bytes(), &p)
	}
	return rec.Code, p
}

func testHandler(a Authenticator) http.Handler {
	return NewHandler(Config{MaxBodyBytes: 1 << 16, Defaults: task.Defaults{MaxAttempts: 3}},
		Deps{Store: nopStore{}, Admin: nopAdmin{}, Auth: a, Log: slog.New(slog.DiscardHandler),
			TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry()})
}

// refusingAuthenticator lets nobody in.
type refusingAuthenticator struct{}

func (refusingAuthenticator) Authenticate(context.Context, string) (auth.Principal, error) {
	return auth.Principal{}, &auth.Error{Reason: auth.ReasonMissing, Message: "no", Err: errors.New("no")}
}

// nopStore and nopAdmin answer every call with nothing, successfully.
type nopStore struct{}

func (nopStore) Submit(context.Context, auth.Principal, task.Submission, task.Carrier) (task.Submitted, error) {
	return task.Submitted{Created: true}, nil
}
func (nopStore) SubmitBatch(_ context.Context, _ auth.Principal, subs []task.Submission, _ task.Carrier) ([]task.Submitted, error) {
	return make([]task.Submitted, len(subs)), nil
}
func (nopStore) Get(context.Context, auth.Principal, uuid.UUID) (task.Task, error) {
	return task.Task{}, nil
}
func (nopStore) List(context.Context, auth.Principal, task.ListFilter) ([]task.Task, error) {
	return nil, nil
}
func (nopStore) Events(context.Context, auth.Principal, uuid.UUID, int, int64) ([]task.Event, error) {
	return nil, nil
}
func (nopStore) OrgReached(context.Context, auth.Principal, int64) (bool, error) {
	return false, nil
}

func (nopStore) EventsBetween(context.Context, auth.Principal, task.EventFilter, int64, int64, int) ([]task.Event, error) {
	return nil, nil
}
func (nopStore) Cancel(context.Context, auth.Principal, uuid.UUID, task.Carrier) (task.Task, task.CancelOutcome, error) {
	return task.Task{}, task.CancelOutcome(0), nil
}
func (nopStore) Retry(context.Context, auth.Principal, uuid.UUID, task.Carrier) (task.Task, error) {
	return task.Task{}, nil
}
func (nopStore) Bulk(context.Context, auth.Principal, task.Bulk, task.Carrier) (task.BulkResult, error) {
	return task.BulkResult{}, nil
}
func (nopStore) Overview(context.Context, auth.Principal, []string) (task.Overview, error) {
	return task.Overview{}, nil
}
func (nopStore) KnownTypes(context.Context) ([]string, error) { return nil, nil }
func (nopStore) AdmitTypes(context.Context, auth.Principal, []task.Submission, int) error {
	return nil
}
func (nopStore) Ping(context.Context) error { return nil }

type nopAdmin struct{}

func (nopAdmin) CreateKey(context.Context, auth.Principal, auth.KeyInput) (auth.Key, string, error) {
	return auth.Key{}, "", nil
}
func (nopAdmin) ListKeys(context.Context, auth.Principal, uuid.UUID, int) ([]auth.Key, error) {
	return nil, nil
}
func (nopAdmin) RevokeKey(context.Context, auth.Principal, uuid.UUID) (auth.Key, error) {
	return auth.Key{}, nil
}
func (nopAdmin) CreateUser(context.Context, auth.Principal, auth.UserInput) (auth.User, error) {
	return auth.User{}, nil
}
func (nopAdmin) ListUsers(context.Context, auth.Principal, uuid.UUID, int) ([]auth.User, error) {
	return nil, nil
}
func (nopAdmin) SetUserRole(context.Context, auth.Principal, uuid.UUID, auth.Role) (auth.User, error) {
	return auth.User{}, nil
}
func (nopAdmin) DeleteUser(context.Context, auth.Principal, uuid.UUID) error { return nil }
func (nopAdmin) CreateRole(context.Context, auth.Principal, string, string) (auth.OrgRole, error) {
	return auth.OrgRole{}, nil
}
func (nopAdmin) ListRoles(context.Context, auth.Principal) ([]auth.OrgRole, error)  { return nil, nil }
func (nopAdmin) DeleteRole(context.Context, auth.Principal, string) error           { return nil }
func (nopAdmin) AddMember(context.Context, auth.Principal, string, uuid.UUID) error { return nil }
func (nopAdmin) RemoveMember(context.Context, auth.Principal, string, uuid.UUID) error {
	return nil
}
func (nopAdmin) ListMembers(context.Context, auth.Principal, string, uuid.UUID, int) ([]auth.User, error) {
	return nil, nil
}

// TestOpenAPIParsesAsWritten keeps the document what its authors wrote: a
// comma in an unquoted description of a flow mapping ends the description
// and makes the rest a key without a value, and an operation lists each
// parameter once (knownParams names them in its 400).
func TestOpenAPIParsesAsWritten(t *testing.T) {
	t.Parallel()
	var doc any
	require.NoError(t, yaml.Unmarshal(openAPI, &doc))
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				require.False(t, x == nil && strings.Contains(k, " "), "%s: %q is a key without a value: quote the text it was cut from", path, k)
				walk(path+"/"+k, x)
			}
		case []any:
			for i, x := range v {
				walk(fmt.Sprintf("%s[%d]", path, i), x)
			}
		}
	}
	walk("", doc)
	for op, names := range queryParams {
		require.Len(t, names, len(slices.Compact(slices.Sorted(slices.Values(names)))), "%s lists a query parameter twice: %v", op, names)
	}
}

// TestMethodNotAllowedSaysWhatIs keeps the 405 a 405 (RFC 9110): its Allow
// header lists the methods the path is served with.
func TestMethodNotAllowedSaysWhatIs(t *testing.T) {
	t.Parallel()
	h := testHandler(DevMode(auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Admin}))
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodDelete, "/v1/tasks/" + uuid.NewString(), "GET, HEAD"},
		{http.MethodPut, "/v1/tasks", "GET, HEAD, POST"},
		{http.MethodGet, "/v1/tasks/" + uuid.NewString() + "/cancel", "POST"},
		{http.MethodPost, "/v1/users/" + uuid.NewString(), "PATCH, DELETE"},
		{"BREW", "/v1/tasks", "GET, HEAD, POST"},
		{http.MethodPost, "/healthz", "GET, HEAD"},
	} {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(c.method, c.path, nil))
		require.Equal(t, http.StatusMethodNotAllowed, rec.Code, "%s %s: %s", c.method, c.path, rec.Body)
		require.Equal(t, c.allow, rec.Header().Get("Allow"), "%s %s", c.method, c.path)
		require.Equal(t, "application/problem+json", rec.Header().Get("Content-Type"))
	}
}
