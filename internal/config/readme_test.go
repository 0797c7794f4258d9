package config_test

import (
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
)

// TestREADMEDocumentsEveryVariable keeps the README's table of variables
// ("Configuration") true: every variable a binary reads has a row, with
// its default and the binaries that read it, and every row names
// variables that some binary reads (or Go's runtime, or the trace
// exporter's OTEL_*).
func TestREADMEDocumentsEveryVariable(t *testing.T) {
	t.Parallel()
	type variable struct {
		def     string
		readers []string
	}
	read := map[string]*variable{}
	for _, c := range []struct {
		binary string
		cfg    any
	}{{"api", config.API{}}, {"relay", config.Relay{}}, {"worker", config.Worker{}}} {
		var walk func(reflect.Type)
		walk = func(typ reflect.Type) {
			for i := range typ.NumField() {
				f := typ.Field(i)
				if f.Anonymous {
					walk(f.Type)
					continue
				}
				name := f.Tag.Get("envconfig")
				if name == "" {
					continue
				}
				if read[name] == nil {
					read[name] = &variable{def: f.Tag.Get("default")}
				}
				read[name].readers = append(read[name].readers, c.binary)
			}
		}
		walk(reflect.TypeOf(c.cfg))
	}

	type row struct{ defaults, usedBy string }
	rows := map[string]row{}
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	_, table, ok := strings.Cut(string(readme), "| variable | default | used by |\n|---|---|---|\n")
	require.True(t, ok, "README.md has no table of variables")
	table, _, _ = strings.Cut(table, "\n\n")
	names := regexp.MustCompile("`([A-Z][A-Z0-9_]*\\*?)`")
	for _, line := range strings.Split(table, "\n") {
		cells := strings.Split(strings.Trim(line, "|"), " | ")
		require.GreaterOrEqual(t, len(cells), 3, "a row of three cells: %s", line)
		for _, m := range names.FindAllStringSubmatch(cells[0], -1) {
			rows[m[1]] = row{defaults: cells[1], usedBy: strings.TrimSpace(cells[2])}
		}
	}

	for name, v := range read {
		r, ok := rows[name]
		if !ok && strings.HasPrefix(name, "OTEL_") {
			r, ok = rows["OTEL_*"]
		}
		require.True(t, ok, "%s (read by %v) has no row in README.md's table of variables", name, v.readers)
		if v.def != "" {
			require.Contains(t, r.defaults, "`"+v.def+"`", "%s: README.md does not give its default", name)
		}
		var want string
		if len(v.readers) == 3 {
			want = "all"
		} else {
			want = strings.Join(v.readers, ", ")
		}
		used := regexp.MustCompile(`^(all|api|relay|worker)(, (api|relay|worker))*`).FindString(r.usedBy)
		require.Equal(t, want, used, "%s: README.md says which binaries read it as %q", name, r.usedBy)
	}
	for name := range rows {
		if name == "OTEL_*" || name == "GOMAXPROCS" || name == "GOGC" {
			continue // the trace exporter's and Go's own
		}
		require.Contains(t, read, name, "README.md's table of variables names %s, which no binary reads", name)
	}
}
