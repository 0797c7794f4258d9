package httpapi

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/go-chi/chi/v5"
	"gopkg.in/yaml.v3"

	"github.com/conveyorhq/conveyor/internal/task"
)

// queryParams are the query parameters openapi.yaml documents for each of
// its operations, by method and path ("GET /v1/tasks/{id}"): the one list
// of what each route takes, which the server enforces (knownParams) and a
// test keeps in step with the handlers.
var queryParams = mustQueryParams(openAPI)

func mustQueryParams(spec []byte) map[string][]string {
	type param struct {
		Ref  string `yaml:"$ref"`
		Name string `yaml:"name"`
		In   string `yaml:"in"`
	}
	var doc struct {
		Paths      map[string]map[string]yaml.Node `yaml:"paths"`
		Components struct {
			Parameters map[string]param `yaml:"parameters"`
		} `yaml:"components"`
	}
	if err := yaml.Unmarshal(spec, &doc); err != nil {
		panic(fmt.Sprintf("openapi.yaml: %v", err))
	}
	queryOf := func(ps []param) []string {
		var names []string
		for _, p := range ps {
			if ref, ok := strings.CutPrefix(p.Ref, "#/components/parameters/"); ok {
				p = doc.Components.Parameters[ref]
			}
			if p.In == "query" {
				names = append(names, p.Name)
			}
		}
		return names
	}
	out := map[string][]string{}
	for path, ops := range doc.Paths {
		var shared []param
		if n, ok := ops["parameters"]; ok {
			if err := n.Decode(&shared); err != nil {
				panic(fmt.Sprintf("openapi.yaml: %s parameters: %v", path, err))
			}
		}
		for method, n := range ops {
			if method == "parameters" {
				continue
			}
			var op struct {
				Parameters []param `yaml:"parameters"`
			}
			if err := n.Decode(&op); err != nil {
				panic(fmt.Sprintf("openapi.yaml: %s %s: %v", method, path, err))
			}
			out[strings.ToUpper(method)+" "+path] = append(queryOf(shared), queryOf(op.Parameters)...)
		}
	}
	return out
}

// knownParams refuses a request to an operation of openapi.yaml that
// carries a query parameter the operation does not document: a misspelt
// filter is an error, never silently ignored. routes finds the operation.
func (s *server) knownParams(routes chi.Routes) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.RawQuery != "" {
				method := r.Method
				if method == http.MethodHead {
					method = http.MethodGet // GetHead serves it by the GET route
				}
				rctx := chi.NewRouteContext()
				if routes.Match(rctx, method, r.URL.Path) {
					if known, ok := queryParams[method+" "+rctx.RoutePattern()]; ok {
						// r.URL.Query drops the pairs it cannot parse (a bad
						// escape, a semicolon), and the filter one held would
						// then be ignored without a word.
						q, err := url.ParseQuery(r.URL.RawQuery)
						if err != nil {
							err = task.Errorf(task.ErrCodeMalformed, "malformed query string: %v", err)
						} else {
							err = onlyParams(q, known...)
						}
						if err != nil {
							s.writeError(w, r, err)
							return
						}
					}
				}
			}
			next.ServeHTTP(w, r)
		})
	}
}

// onlyParams rejects query parameters the endpoint does not know, so a typo
// is an error instead of a silently ignored filter.
func onlyParams(q url.Values, known ...string) error {
	for name, values := range q {
		ok := false
		for _, k := range known {
			ok = ok || name == k
		}
		if !ok {
			return task.Errorf(task.ErrCodeMalformed, "unknown query parameter %q (known: %v)", name, known)
		}
		if len(values) > 1 {
			return task.Errorf(task.ErrCodeMalformed, "query parameter %q given %d times", name, len(values))
		}
	}
	return nil
}
