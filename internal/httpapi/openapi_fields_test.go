package httpapi

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http/httptest"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"
	"gopkg.in/yaml.v3"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

// TestOpenAPISchemasMatchViews keeps the document's fields true: each
// schema of what the API answers (or reads) lists exactly the fields of
// its Go type, found by encoding a value of that type with every field set. A
// field added to a view but not to openapi.yaml, or one the document
// promises that no answer carries, fails here; nested objects and arrays
// are compared too.
func TestOpenAPISchemasMatchViews(t *testing.T) {
	t.Parallel()
	one, yes := 1, true
	for _, c := range []struct {
		schema string
		value  any
	}{
		{"Task", taskView{}},
		{"TaskSummary", taskSummary{}},
		{"Event", eventView{}},
		{"Key", keyView{}},
		{"User", userView{}},
		{"Role", roleView{}},
		{"Problem", problem{}},
		{"Overview", overviewView{}},
		{"Job", jobView{}},
		{"TypeState", typeStateView{}},
		{"Change", job.Change{}},
		{"FileError", job.Problem{}},
		{"Workflow", workflowView{}},
		{"Run", runView{}},
		{"RunNode", runNodeView{}},
		{"Lineage", job.Lineage{}},
		{"SubmitRequest", submitRequest{}},
		{"TaskFilter", filterInput{}},
		{"BulkRequest", bulkRequest{}},
		{"JobDefinition", job.Definition{}},
		{"TypeLimit", job.TypeLimit{}},
		{"WorkflowDefinition", job.Workflow{}},
		{"paths./v1/tasks/batch.post.requestBody", struct {
			Tasks []batchEntry `json:"tasks"`
		}{}},
		// The bulk actions' answers: each names its own count.
		{"paths./v1/tasks/cancel.post.responses.200", bulkResponse{Matched: 1, Cancelled: &one, Skipped: &one, More: &yes}},
		{"paths./v1/tasks/retry.post.responses.200", bulkResponse{Matched: 1, Retried: &one, Skipped: &one, More: &yes}},
	} {
		t.Run(c.schema, func(t *testing.T) {
			schema := lookupSchema(t, c.schema)
			v := reflect.New(reflect.TypeOf(c.value)).Elem()
			if reflect.ValueOf(c.value).IsZero() {
				fillValue(v, 0)
			} else {
				v.Set(reflect.ValueOf(c.value))
			}
			raw, err := json.Marshal(v.Interface())
			require.NoError(t, err)
			var got any
			require.NoError(t, json.Unmarshal(raw, &got))
			var mismatches []string
			compareToSchema(c.schema, got, schema, true, &mismatches)
			require.Empty(t, mismatches, "openapi.yaml and %T disagree; the value as encoded: %s", c.value, raw)
		})
	}
}

// TestOpenAPIDocumentsWhatEachOperationAnswers calls every operation as an
// admin, against stores that succeed at everything, and checks
// that the document lists the status it answers and, for a JSON answer,
// every field of it: the listings' wrappers and the answers built in the
// handlers included.
func TestOpenAPIDocumentsWhatEachOperationAnswers(t *testing.T) {
	t.Parallel()
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, Defaults: task.Defaults{MaxAttempts: 3}},
		Deps{Store: nopStore{}, Admin: nopAdmin{}, Jobs: nopJobs{}, Workflows: nopWorkflows{},
			Auth: DevMode(auth.Principal{Kind: auth.KindKey, ID: uuid.New(), OrgID: uuid.New(), Role: auth.Admin}),
			Log:  slog.New(slog.DiscardHandler), TracerProvider: noop.NewTracerProvider(),
			Propagator: propagation.TraceContext{}, Registry: prometheus.NewRegistry()})
	for _, op := range documentedOperations(t) {
		t.Run(op.Method+" "+op.Path, func(t *testing.T) {
			query, contentType, body := "", "application/json", "{}"
			switch op.Method + " " + op.Path {
			case "GET /v1/lineage":
				query = "dataset=raw.orders"
			case "POST /v1/jobs/apply":
				contentType, body = "application/yaml", "jobs: []\n"
			case "POST /v1/tasks":
				body = `{"type":"demo.noop"}`
			case "POST /v1/tasks/batch":
				body = `{"tasks":[{"type":"demo.noop"}]}`
			case "POST /v1/keys":
				body = `{"name":"k","role":"reader"}`
			case "POST /v1/users":
				body = `{"external_id":"u","role":"reader"}`
			case "PATCH /v1/users/{id}":
				body = `{"role":"reader"}`
			case "POST /v1/roles":
				body = `{"slug":"ops"}`
			}
			path := strings.NewReplacer("{id}", uuid.NewString(), "{user_id}", uuid.NewString(), "{slug}", "ops",
				"{name}", "nightly", "{type}", "demo.noop").Replace(op.Path)
			if query != "" {
				path += "?" + query
			}
			req := httptest.NewRequest(op.Method, path, strings.NewReader(body))
			req.Header.Set("Content-Type", contentType)
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			status := strconv.Itoa(rec.Code)
			require.Contains(t, op.Responses, status, "answered %s, not in the document: %s", status, rec.Body)
			if !strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") {
				return
			}
			schema := responseSchema(op.Path + "." + strings.ToLower(op.Method) + ".responses." + status)
			require.NotNil(t, schema, "answered JSON the document does not describe: %s", rec.Body)
			var got any
			require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &got))
			var mismatches []string
			compareToSchema(op.Method+" "+op.Path, got, schema, false, &mismatches)
			require.Empty(t, mismatches, "the answer: %s", rec.Body)
		})
	}
}

// nopJobs and nopWorkflows answer every call with nothing, successfully.
type nopJobs struct{}

func (nopJobs) Jobs(context.Context, auth.Principal) ([]job.Stored, error) {
	return []job.Stored{{}}, nil
}
func (nopJobs) Job(context.Context, auth.Principal, string) (job.Stored, error) {
	return job.Stored{}, nil
}
func (nopJobs) TypeLimits(context.Context, auth.Principal) ([]job.TypeState, error) {
	return []job.TypeState{{}}, nil
}
func (nopJobs) Apply(context.Context, auth.Principal, job.File, bool, bool) ([]job.Change, error) {
	return []job.Change{{}}, nil
}
func (nopJobs) PauseJob(context.Context, auth.Principal, string, bool) error  { return nil }
func (nopJobs) PauseType(context.Context, auth.Principal, string, bool) error { return nil }
func (nopJobs) Trigger(context.Context, auth.Principal, string, json.RawMessage, string, task.Carrier) (task.Task, error) {
	return task.Task{}, nil
}

type nopWorkflows struct{}

func (nopWorkflows) Workflows(context.Context, auth.Principal) ([]job.StoredWorkflow, error) {
	return []job.StoredWorkflow{{}}, nil
}
func (nopWorkflows) Workflow(context.Context, auth.Principal, string) (job.StoredWorkflow, error) {
	return job.StoredWorkflow{}, nil
}
func (nopWorkflows) StartRun(context.Context, auth.Principal, string, job.RunRequest) (job.Run, error) {
	return job.Run{}, nil
}
func (nopWorkflows) Runs(context.Context, auth.Principal, string, uuid.UUID, int) ([]job.Run, error) {
	return []job.Run{{}, {}}, nil
}
func (nopWorkflows) Run(context.Context, auth.Principal, uuid.UUID) (job.Run, error) {
	return job.Run{}, nil
}
func (nopWorkflows) CancelRun(context.Context, auth.Principal, uuid.UUID, task.Carrier) (job.Run, error) {
	return job.Run{}, nil
}
func (nopWorkflows) RetryRun(context.Context, auth.Principal, uuid.UUID, task.Carrier) (job.Run, error) {
	return job.Run{}, nil
}
func (nopWorkflows) Lineage(context.Context, auth.Principal, string, int) (job.Lineage, error) {
	return job.Lineage{}, nil
}

// responseSchema is the schema of the JSON content of a response or a
// request body, named as path.method.responses.status or
// path.method.requestBody; nil when the document gives none.
func responseSchema(name string) map[string]any {
	// The path itself holds dots: it ends at the method.
	for _, method := range []string{".get.", ".post.", ".put.", ".patch.", ".delete."} {
		path, rest, ok := strings.Cut(name, method)
		if !ok {
			continue
		}
		at := openAPIDoc["paths"]
		for _, part := range append([]string{path, strings.Trim(method, ".")}, strings.Split(rest, ".")...) {
			at, _ = at.(map[string]any)[part]
		}
		if ref, ok := at.(map[string]any)["$ref"].(string); ok {
			at = resolveSchema(map[string]any{"$ref": ref})
		}
		content, _ := at.(map[string]any)["content"].(map[string]any)
		media, _ := content["application/json"].(map[string]any)
		s, _ := media["schema"].(map[string]any)
		return s
	}
	return nil
}

var openAPIDoc = func() map[string]any {
	var doc map[string]any
	if err := yaml.Unmarshal(openAPI, &doc); err != nil {
		panic(err)
	}
	return doc
}()

// lookupSchema finds a schema by its name under components/schemas, or by
// a dotted path to an operation's request body or response (its JSON
// content's schema).
func lookupSchema(t *testing.T, name string) map[string]any {
	t.Helper()
	if path, ok := strings.CutPrefix(name, "paths."); ok {
		s := responseSchema(path)
		require.NotNil(t, s, "%s: no such response schema", name)
		return s
	}
	s, ok := openAPIDoc["components"].(map[string]any)["schemas"].(map[string]any)[name].(map[string]any)
	require.True(t, ok, "%s: no such schema", name)
	return s
}

// resolveSchema follows $ref and merges allOf, so that a schema's
// properties, additionalProperties and items are found in one map.
func resolveSchema(s map[string]any) map[string]any {
	if ref, ok := s["$ref"].(string); ok {
		var at any = openAPIDoc
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			at = at.(map[string]any)[part]
		}
		return resolveSchema(at.(map[string]any))
	}
	all, ok := s["allOf"].([]any)
	if !ok {
		return s
	}
	merged := map[string]any{}
	props := map[string]any{}
	for k, v := range s {
		if k != "allOf" {
			merged[k] = v
		}
	}
	if p, ok := s["properties"].(map[string]any); ok {
		maps.Copy(props, p)
	}
	for _, part := range all {
		r := resolveSchema(part.(map[string]any))
		for k, v := range r {
			if k == "properties" {
				maps.Copy(props, v.(map[string]any))
			} else if _, set := merged[k]; !set {
				merged[k] = v
			}
		}
	}
	if len(props) > 0 {
		merged["properties"] = props
	}
	return merged
}

// compareToSchema notes where the encoded value v and the schema differ:
// a field v has that the schema does not list, or, if whole, one it lists
// that v lacks. An empty object is taken for opaque JSON (a payload) and
// not compared.
func compareToSchema(path string, v any, schema map[string]any, whole bool, mismatches *[]string) {
	schema = resolveSchema(schema)
	switch v := v.(type) {
	case map[string]any:
		if len(v) == 0 {
			return
		}
		props, ok := schema["properties"].(map[string]any)
		if !ok {
			if extra, ok := schema["additionalProperties"].(map[string]any); ok {
				for k, x := range v {
					compareToSchema(path+"."+k, x, extra, whole, mismatches)
				}
			}
			return
		}
		for _, k := range slices.Sorted(maps.Keys(v)) {
			p, ok := props[k].(map[string]any)
			if !ok {
				*mismatches = append(*mismatches, fmt.Sprintf("%s.%s: answered but not in the document", path, k))
				continue
			}
			compareToSchema(path+"."+k, v[k], p, whole, mismatches)
		}
		for _, k := range slices.Sorted(maps.Keys(props)) {
			if _, ok := v[k]; !ok && whole {
				*mismatches = append(*mismatches, fmt.Sprintf("%s.%s: in the document but never answered", path, k))
			}
		}
	case []any:
		if items, ok := schema["items"].(map[string]any); ok {
			for i, x := range v {
				compareToSchema(fmt.Sprintf("%s[%d]", path, i), x, items, whole, mismatches)
			}
		}
	}
}

// fillValue sets every exported field of v, and of what it holds, to a
// value that is not its zero, so that no omitempty field is left out of
// its encoding. A json.RawMessage becomes an empty object.
func fillValue(v reflect.Value, depth int) {
	if depth > 8 {
		return
	}
	switch v.Type() {
	case reflect.TypeOf(time.Time{}):
		v.Set(reflect.ValueOf(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)))
		return
	case reflect.TypeOf(json.RawMessage{}):
		v.SetBytes([]byte("{}"))
		return
	}
	switch v.Kind() {
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fillValue(v.Elem(), depth+1)
	case reflect.Struct:
		for i := range v.NumField() {
			// An embedded view's fields are promoted, exported or not.
			if f := v.Type().Field(i); f.IsExported() || f.Anonymous {
				fillValue(v.Field(i), depth+1)
			}
		}
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fillValue(v.Index(0), depth+1)
	case reflect.Array:
		for i := range v.Len() {
			fillValue(v.Index(i), depth+1)
		}
	case reflect.Map:
		v.Set(reflect.MakeMap(v.Type()))
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		fillValue(k, depth+1)
		fillValue(e, depth+1)
		v.SetMapIndex(k, e)
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(1)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(1)
	case reflect.Float32, reflect.Float64:
		v.SetFloat(1)
	}
}
