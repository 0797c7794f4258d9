package job

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Op is what applying a file does to one job or type limit.
type Op string

// The ops.
const (
	OpCreate    Op = "create"
	OpUpdate    Op = "update"
	OpUnchanged Op = "unchanged"
	OpDelete    Op = "delete"
)

// The kinds of thing a Change is about.
const (
	KindJob  = "job"
	KindType = "type"
)

// FieldChange is one field of a created or updated job or type limit, its
// values rendered as short strings: JSON for the payload, "" when absent.
type FieldChange struct {
	Field string `json:"field"`
	Old   string `json:"old"`
	New   string `json:"new"`
}

// Change is what applying a file does to one job (by name) or type limit
// (by type). Fields lists every field that differs for an update, and every
// field set for a create.
type Change struct {
	Op     Op            `json:"op"`
	Kind   string        `json:"kind"`
	Name   string        `json:"name"`
	Fields []FieldChange `json:"fields,omitempty"`
}

// field is one comparable field, rendered as Diff shows it.
type field[T any] struct {
	name   string
	quoted bool // Format quotes its values
	render func(T) string
}

var jobFields = []field[Definition]{
	{"type", true, func(d Definition) string { return d.Type }},
	{"payload", false, func(d Definition) string { return string(d.Payload) }},
	{"priority", false, func(d Definition) string { return strconv.Itoa(d.Priority) }},
	{"source.kind", true, sourceField(func(s *Source) string { return s.Kind })},
	{"source.schedule", true, sourceField(func(s *Source) string { return s.Schedule })},
	{"source.timezone", true, sourceField(func(s *Source) string { return s.Timezone })},
	{"source.missed", true, sourceField(func(s *Source) string { return s.Missed })},
	{"max_attempts", false, func(d Definition) string { return strconv.Itoa(d.MaxAttempts) }},
	{"timeout_seconds", false, func(d Definition) string { return optional(d.TimeoutSeconds) }},
	{"heartbeat_timeout_seconds", false, func(d Definition) string { return optional(d.HeartbeatTimeoutSeconds) }},
	{"max_concurrency", false, func(d Definition) string { return optional(d.MaxConcurrency) }},
	{"max_concurrency_per_key", false, func(d Definition) string { return optional(d.MaxConcurrencyPerKey) }},
	{"active", false, func(d Definition) string { return strconv.FormatBool(d.Active) }},
}

var typeFields = []field[TypeLimit]{
	{"max_concurrency", false, func(t TypeLimit) string { return optional(t.MaxConcurrency) }},
	{"max_concurrency_per_key", false, func(t TypeLimit) string { return optional(t.MaxConcurrencyPerKey) }},
}

// quoted tells Format which fields hold free text, whatever their kind.
var quoted = func() map[string]bool {
	m := map[string]bool{}
	for _, f := range jobFields {
		m[f.name] = f.quoted
	}
	return m
}()

func sourceField(get func(*Source) string) func(Definition) string {
	return func(d Definition) string {
		if d.Source == nil {
			return ""
		}
		return get(d.Source)
	}
}

func optional(v int) string {
	if v == 0 {
		return ""
	}
	return strconv.Itoa(v)
}

// Diff compares the current state with the desired file: jobs by name
// (unchanged when their hashes match), type limits by type. What current
// has and desired lacks is deleted only when prune is set; otherwise it is
// left out. Changes come jobs first, then by name.
func Diff(current, desired File, prune bool) []Change {
	changes := diff(KindJob, current.Jobs, desired.Jobs, jobFields,
		func(d Definition) string { return d.Name },
		func(d Definition) Definition { return d.Normalized() },
		func(a, b Definition) bool { return a.Hash() == b.Hash() },
		prune)
	changes = append(changes, diff(KindType, current.Types, desired.Types, typeFields,
		func(t TypeLimit) string { return t.Type },
		func(t TypeLimit) TypeLimit { return t },
		func(a, b TypeLimit) bool { return a == b },
		prune)...)
	slices.SortStableFunc(changes, func(a, b Change) int {
		return cmp.Or(cmp.Compare(kindOrder(a.Kind), kindOrder(b.Kind)), cmp.Compare(a.Name, b.Name))
	})
	return changes
}

func kindOrder(kind string) int {
	if kind == KindJob {
		return 0
	}
	return 1
}

func diff[T any](kind string, current, desired []T, fields []field[T], key func(T) string, normalize func(T) T, equal func(a, b T) bool, prune bool) []Change {
	have := make(map[string]T, len(current))
	for _, c := range current {
		have[key(c)] = normalize(c)
	}
	var changes []Change
	wanted := make(map[string]bool, len(desired))
	for _, d := range desired {
		d = normalize(d)
		name := key(d)
		wanted[name] = true
		old, ok := have[name]
		switch {
		case !ok:
			c := Change{Op: OpCreate, Kind: kind, Name: name}
			for _, f := range fields {
				if v := f.render(d); v != "" {
					c.Fields = append(c.Fields, FieldChange{Field: f.name, New: v})
				}
			}
			changes = append(changes, c)
		case equal(old, d):
			changes = append(changes, Change{Op: OpUnchanged, Kind: kind, Name: name})
		default:
			c := Change{Op: OpUpdate, Kind: kind, Name: name}
			for _, f := range fields {
				if o, n := f.render(old), f.render(d); o != n {
					c.Fields = append(c.Fields, FieldChange{Field: f.name, Old: o, New: n})
				}
			}
			changes = append(changes, c)
		}
	}
	if prune {
		for _, c := range current {
			if name := key(c); !wanted[name] {
				wanted[name] = true // once, should current repeat it
				changes = append(changes, Change{Op: OpDelete, Kind: kind, Name: name})
			}
		}
	}
	return changes
}

var opSigns = map[Op]string{OpCreate: "+", OpUpdate: "~", OpUnchanged: "=", OpDelete: "-"}

// Format renders changes as plain text for a terminal, one line each:
// `+ job nightly-report (reports.build, cron "0 2 * * *" Europe/Paris)` for
// a create, `~ job sync: source.schedule "@every 1m" → "@every 30s"` for an
// update, `= job cleanup` for no change and `- job old-thing` for a delete.
func Format(changes []Change) string {
	var b strings.Builder
	for _, c := range changes {
		sign, ok := opSigns[c.Op]
		if !ok {
			sign = "?"
		}
		fmt.Fprintf(&b, "%s %s %s", sign, c.Kind, c.Name)
		switch c.Op {
		case OpCreate:
			b.WriteString(" (" + summary(c) + ")")
		case OpUpdate:
			parts := make([]string, len(c.Fields))
			for i, f := range c.Fields {
				parts[i] = fmt.Sprintf("%s %s → %s", f.Field, show(f.Field, f.Old), show(f.Field, f.New))
			}
			b.WriteString(": " + strings.Join(parts, ", "))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// summary describes a created job by its type and source, or a created
// type limit by its limits.
func summary(c Change) string {
	v := map[string]string{}
	for _, f := range c.Fields {
		v[f.Field] = f.New
	}
	if c.Kind == KindType {
		var parts []string
		for _, f := range typeFields {
			if s := v[f.name]; s != "" {
				parts = append(parts, f.name+" "+s)
			}
		}
		if len(parts) == 0 {
			return "no limits"
		}
		return strings.Join(parts, ", ")
	}
	parts := []string{v["type"]}
	if kind := v["source.kind"]; kind != "" {
		parts = append(parts, fmt.Sprintf("%s %q %s", kind, v["source.schedule"], v["source.timezone"]))
	}
	if v["active"] == "false" {
		parts = append(parts, "inactive")
	}
	return strings.Join(parts, ", ")
}

func show(field, v string) string {
	switch {
	case v == "":
		return "none"
	case quoted[field]:
		return strconv.Quote(v)
	}
	return v
}
