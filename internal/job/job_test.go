package job_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/job"
	"github.com/conveyorhq/conveyor/internal/task"
)

const fullFile = `# every field, then a job with only the required ones
jobs:
  - name: nightly-report
    type: reports.build
    payload:
      format: pdf
      pages: [1, 2]
      meta: {b: true, a: null}
    priority: 7
    source:
      kind: cron
      schedule: "0 2 * * *"
      timezone: Europe/Paris
      missed: skip
    max_attempts: 10
    timeout_seconds: 600
    heartbeat_timeout_seconds: 60
    max_concurrency: 2
    max_concurrency_per_key: 1
    active: false
  - name: sync
    type: crm.sync
    source:
      kind: cron
      schedule: "@every 30s"
  - name: on-demand
    type: emails.send
types:
  - type: emails.send
    max_concurrency: 10
    max_concurrency_per_key: 1
  - type: reports.build
`

func fullWant() job.File {
	return job.File{
		Jobs: []job.Definition{
			{
				Name:                    "nightly-report",
				Type:                    "reports.build",
				Payload:                 json.RawMessage(`{"format":"pdf","meta":{"a":null,"b":true},"pages":[1,2]}`),
				Priority:                7,
				Source:                  &job.Source{Kind: "cron", Schedule: "0 2 * * *", Timezone: "Europe/Paris", Missed: "skip"},
				MaxAttempts:             10,
				TimeoutSeconds:          600,
				HeartbeatTimeoutSeconds: 60,
				MaxConcurrency:          2,
				MaxConcurrencyPerKey:    1,
				Active:                  false,
			},
			{
				Name:        "sync",
				Type:        "crm.sync",
				Payload:     json.RawMessage(`{}`),
				Priority:    5,
				Source:      &job.Source{Kind: "cron", Schedule: "@every 30s", Timezone: "UTC", Missed: "run_once"},
				MaxAttempts: 3,
				Active:      true,
			},
			{Name: "on-demand", Type: "emails.send", Payload: json.RawMessage(`{}`), Priority: 5, MaxAttempts: 3, Active: true},
		},
		Types: []job.TypeLimit{
			{Type: "emails.send", MaxConcurrency: 10, MaxConcurrencyPerKey: 1},
			{Type: "reports.build"},
		},
	}
}

// A valid file parses to its normalised form: defaults filled in and the
// payload in canonical JSON.
func TestParseValidFile(t *testing.T) {
	t.Parallel()
	f, err := job.Parse([]byte(fullFile))
	require.NoError(t, err)
	require.Equal(t, fullWant(), f)
	require.Empty(t, f.Validate())
}

// The same document in JSON parses to the same File.
func TestParseJSON(t *testing.T) {
	t.Parallel()
	b, err := json.MarshalIndent(fullWant(), "", "\t")
	require.NoError(t, err)
	f, err := job.Parse(b)
	require.NoError(t, err)
	require.Equal(t, fullWant(), f)
}

func TestParseEmptyDocuments(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"", "\n", "# nothing yet\n", "---\n", "jobs:\ntypes:\n", "jobs: []\n", "{}"} {
		f, err := job.Parse([]byte(in))
		require.NoError(t, err, "%q", in)
		require.Empty(t, f.Jobs, "%q", in)
		require.Empty(t, f.Types, "%q", in)
	}
}

// Anchors and merge keys share settings between jobs; keys written out win.
func TestParseMergeKeys(t *testing.T) {
	t.Parallel()
	_, err := job.Parse([]byte(`
defaults: &defaults
jobs:
  - &base
    name: a
    type: t
    priority: 2
    payload: &p {x: 1}
  - <<: *base
    name: b
    payload: *p
`))
	require.Error(t, err, "defaults is not a known field")
	require.Equal(t, `line 2: defaults: unknown field "defaults"`, err.Error())

	f, err := job.Parse([]byte(`
jobs:
  - &base
    name: a
    type: t
    priority: 2
    payload: &p {x: 1}
  - <<: *base
    name: b
    payload: *p
`))
	require.NoError(t, err)
	require.Len(t, f.Jobs, 2)
	require.Equal(t, "b", f.Jobs[1].Name)
	require.Equal(t, 2, f.Jobs[1].Priority)
	require.JSONEq(t, `{"x":1}`, string(f.Jobs[1].Payload))
}

// Nested aliases cannot make a small file expensive to walk.
func TestParseAliasBomb(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	b.WriteString("x:\n  - &a0 {name: a, type: t, payload: {k: v}}\n")
	for i := 1; i < 40; i++ {
		fmt.Fprintf(&b, "  - &a%d {<<: [*a%d, *a%d], payload: [*a%d, *a%d]}\n", i, i-1, i-1, i-1, i-1)
	}
	b.WriteString("jobs:\n  - <<: *a39\n")
	_, err := job.Parse([]byte(b.String()))
	require.ErrorContains(t, err, "the file is too large")
}

type want struct {
	line int
	path string
	msg  string // a part of the message
}

// Each mistake is reported at the right line and path.
func TestParseProblems(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		in   string
		want []want
	}{
		{
			name: "unknown key",
			in: `jobs:
  - name: a
    type: t
    source:
      kind: cron
      scheudle: "@hourly"
`,
			want: []want{
				{5, "jobs[0].source.schedule", `"schedule" is required`},
				{6, "jobs[0].source.scheudle", `unknown field "scheudle"`},
			},
		},
		{
			name: "unknown top-level key",
			in:   "job:\n  - name: a\n",
			want: []want{{1, "job", `unknown field "job"`}},
		},
		{
			name: "wrong type",
			in:   "jobs:\n  - name: a\n    type: t\n    max_attempts: \"three\"\n",
			want: []want{{4, "jobs[0].max_attempts", `max_attempts must be an integer, not the string "three"`}},
		},
		{
			name: "fraction for an integer",
			in:   "jobs:\n  - name: a\n    type: t\n    priority: 2.5\n",
			want: []want{{4, "jobs[0].priority", "must be an integer, not the number 2.5"}},
		},
		{
			name: "number for a string",
			in:   "jobs:\n  - name: 2024\n    type: t\n",
			want: []want{{2, "jobs[0].name", "name must be a string, not the integer 2024 (quote it)"}},
		},
		{
			name: "yes is not a boolean",
			in:   "jobs:\n  - name: a\n    type: t\n    active: yes\n",
			want: []want{{4, "jobs[0].active", `active must be true or false, not the string "yes"`}},
		},
		{
			name: "bad name",
			in:   "jobs:\n  - name: Nightly Report\n    type: t\n",
			want: []want{{2, "jobs[0].name", `invalid name "Nightly Report"`}},
		},
		{
			name: "bad cron spec",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      kind: cron\n      schedule: \"0 25 * * *\"\n",
			want: []want{{6, "jobs[0].source.schedule", `invalid schedule "0 25 * * *"`}},
		},
		{
			name: "bad timezone",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      kind: cron\n      schedule: \"@daily\"\n      timezone: Mars/Olympus\n",
			want: []want{{7, "jobs[0].source.timezone", `unknown timezone "Mars/Olympus"`}},
		},
		{
			name: "missing type",
			in:   "jobs:\n  - name: a\n    priority: 1\n",
			want: []want{{2, "jobs[0].type", `"type" is required`}},
		},
		{
			name: "missing kind",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      schedule: \"@daily\"\n",
			want: []want{{5, "jobs[0].source.kind", `"kind" is required`}},
		},
		{
			name: "unsupported kind",
			in:   "jobs:\n  - name: a\n    type: t\n    source: {kind: webhook, schedule: \"@daily\"}\n",
			want: []want{{4, "jobs[0].source.kind", `unsupported source kind "webhook"`}},
		},
		{
			name: "duplicate name points at the second",
			in:   "jobs:\n  - name: a\n    type: t\n  - name: b\n    type: t\n  - name: a\n    type: u\n",
			want: []want{{6, "jobs[2].name", `duplicate job name "a": jobs[0] already has it`}},
		},
		{
			name: "duplicate type limit",
			in:   "types:\n  - type: t\n  - type: t\n    max_concurrency: 1\n",
			want: []want{{3, "types[1].type", `duplicate type "t"`}},
		},
		{
			name: "duplicate key",
			in:   "jobs:\n  - name: a\n    type: t\n    type: u\n",
			want: []want{{4, "jobs[0].type", `duplicate field "type"`}},
		},
		{
			name: "payload not a mapping",
			in:   "jobs:\n  - name: a\n    type: t\n    payload: [1, 2]\n",
			want: []want{{4, "jobs[0].payload", "payload must be a mapping, not a list"}},
		},
		{
			name: "payload with no JSON form",
			in:   "jobs:\n  - name: a\n    type: t\n    payload:\n      ratio: .inf\n",
			want: []want{{5, "jobs[0].payload.ratio", ".inf has no JSON form"}},
		},
		{
			name: "out-of-range numbers",
			in: `jobs:
  - name: a
    type: t
    priority: 12
    max_attempts: 0
    timeout_seconds: 604801
    heartbeat_timeout_seconds: -1
    max_concurrency: 0
    max_concurrency_per_key: 10001
types:
  - type: t
    max_concurrency: 0
`,
			want: []want{
				{4, "jobs[0].priority", "priority must be between 0 and 9, got 12"},
				{5, "jobs[0].max_attempts", "max_attempts must be between 1 and 100, got 0"},
				{6, "jobs[0].timeout_seconds", "timeout_seconds must be between 1 and 604800, got 604801"},
				{7, "jobs[0].heartbeat_timeout_seconds", "heartbeat_timeout_seconds must be between 1 and 86400, got -1"},
				{8, "jobs[0].max_concurrency", "max_concurrency must be between 1 and 10000, got 0 (leave it out for no limit)"},
				{9, "jobs[0].max_concurrency_per_key", "max_concurrency_per_key must be between 1 and 10000, got 10001"},
				{12, "types[0].max_concurrency", "max_concurrency must be between 1 and 10000, got 0"},
			},
		},
		{
			name: "every under a second",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      kind: cron\n      schedule: \"@every 500ms\"\n",
			want: []want{{6, "jobs[0].source.schedule", "the interval must be at least 1s"}},
		},
		{
			name: "time zone inside the spec",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      kind: cron\n      schedule: \"CRON_TZ=Europe/Paris 0 2 * * *\"\n",
			want: []want{{6, "jobs[0].source.schedule", "give the time zone in the timezone field"}},
		},
		{
			name: "missed sometimes",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      kind: cron\n      schedule: \"@daily\"\n      missed: sometimes\n",
			want: []want{{7, "jobs[0].source.missed", `invalid missed "sometimes": use "skip" or "run_once"`}},
		},
		{
			name: "YAML syntax error",
			in:   "jobs:\n  - name: a\n    type: t\n  oops\n",
			want: []want{{4, "", "invalid YAML: could not find expected ':'"}},
		},
		{
			name: "unquoted descriptor",
			in:   "jobs:\n  - name: a\n    type: t\n    source:\n      kind: cron\n      schedule: @daily\n",
			want: []want{{6, "", `values starting with "@"`}},
		},
		{
			name: "tab indentation",
			in:   "jobs:\n  - name: a\n\ttype: t\n",
			want: []want{{2, "", "invalid YAML: found a tab character"}},
		},
		{
			name: "document is a list",
			in:   "- name: a\n",
			want: []want{{1, "", "the document must be a mapping, not a list"}},
		},
		{
			name: "jobs is a mapping",
			in:   "jobs:\n  name: a\n",
			want: []want{{2, "jobs", "jobs must be a list, not a mapping"}},
		},
		{
			name: "job is a string",
			in:   "jobs:\n  - a\n",
			want: []want{{2, "jobs[0]", `a job must be a mapping, not the string "a"`}},
		},
		{
			name: "two documents",
			in:   "jobs: []\n---\ntypes: []\n",
			want: []want{{2, "", "more than one YAML document"}},
		},
		{
			name: "several mistakes, in file order",
			in: `jobs:
  - name: a
    type: t
    priority: high
  - name: Bad
    source:
      kind: cron
      schedule: "* * *"
      timezone: Nowhere/Else
    colour: red
  - name: a
    type: t
types:
  - max_concurrency: 5
`,
			want: []want{
				{4, "jobs[0].priority", "must be an integer"},
				{5, "jobs[1].type", `"type" is required`}, // at the mapping, column 5
				{5, "jobs[1].name", `invalid name "Bad"`}, // at the value, column 11
				{8, "jobs[1].source.schedule", "expected 5 to 6 fields, found 3"},
				{9, "jobs[1].source.timezone", `unknown timezone "Nowhere/Else"`},
				{10, "jobs[1].colour", `unknown field "colour"`},
				{11, "jobs[2].name", `duplicate job name "a"`},
				{14, "types[0].type", `"type" is required`},
			},
		},
		{
			name: "JSON reports lines too",
			in: `{
  "jobs": [
    {"name": "a", "type": "t"},
    {
      "name": "b",
      "type": "t",
      "priority": "1",
      "source": {"kind": "cron", "schedule": "@every 0s"}
    }
  ]
}`,
			want: []want{
				{7, "jobs[1].priority", `priority must be an integer, not the string "1"`},
				{8, "jobs[1].source.schedule", "the interval must be at least 1s"},
			},
		},
		{
			name: "JSON syntax error",
			in:   "{\"jobs\": [\n  {\"name\": \"a\",}\n",
			want: []want{{2, "", "invalid YAML"}},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f, err := job.Parse([]byte(tt.in))
			require.Error(t, err)
			require.Equal(t, job.File{}, f)
			var ps job.Problems
			require.True(t, errors.As(err, &ps), "%T", err)
			got := make([]want, len(ps))
			for i, p := range ps {
				got[i] = want{p.Line, p.Path, p.Message}
				if i < len(tt.want) && strings.Contains(p.Message, tt.want[i].msg) {
					got[i].msg = tt.want[i].msg // compare the part the test names
				}
			}
			require.Equal(t, tt.want, got, "%v", err)
		})
	}
}

func TestProblemsError(t *testing.T) {
	t.Parallel()
	ps := job.Problems{
		{Line: 7, Column: 17, Path: "jobs[1].source.schedule", Message: "bad"},
		{Path: "name", Message: `"name" is required`},
		{Line: 3, Message: "invalid YAML"},
	}
	require.Equal(t, "line 7: jobs[1].source.schedule: bad\nname: \"name\" is required\nline 3: invalid YAML", ps.Error())
	b, err := json.Marshal(ps[0])
	require.NoError(t, err)
	require.JSONEq(t, `{"line":7,"column":17,"path":"jobs[1].source.schedule","message":"bad"}`, string(b))
}

// Validate runs the rule checks of Parse on a definition built in Go, such
// as one decoded from an API body, where empty means "default".
func TestValidateDefinition(t *testing.T) {
	t.Parallel()
	valid := job.Definition{Name: "a", Type: "t", MaxAttempts: 1, Source: &job.Source{Kind: "cron", Schedule: "@daily"}}
	require.Empty(t, valid.Validate())

	for _, tt := range []struct {
		name  string
		edit  func(*job.Definition)
		paths []string
	}{
		{"empty", func(d *job.Definition) { *d = job.Definition{} }, []string{"name", "type", "max_attempts"}},
		{"payload array", func(d *job.Definition) { d.Payload = json.RawMessage(`[1]`) }, []string{"payload"}},
		{"payload invalid", func(d *job.Definition) { d.Payload = json.RawMessage(`{"a":}`) }, []string{"payload"}},
		{"payload duplicate key", func(d *job.Definition) { d.Payload = json.RawMessage(`{"a":1,"a":2}`) }, []string{"payload"}},
		{"payload NUL", func(d *job.Definition) { d.Payload = json.RawMessage(`{"a":"\u0000"}`) }, []string{"payload"}},
		{"payload too deep", func(d *job.Definition) {
			d.Payload = json.RawMessage(`{"a":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}`)
		}, []string{"payload"}},
		{"source empty", func(d *job.Definition) { d.Source = &job.Source{} }, []string{"source.kind", "source.schedule"}},
		{"local time", func(d *job.Definition) { d.Source.Timezone = "Local" }, []string{"source.timezone"}},
		{"bad timezone and schedule", func(d *job.Definition) { d.Source.Timezone = "X"; d.Source.Schedule = "@often" }, []string{"source.schedule", "source.timezone"}},
		{"negative limit", func(d *job.Definition) { d.MaxConcurrency = -1 }, []string{"max_concurrency"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			d := valid
			s := *valid.Source
			d.Source = &s
			tt.edit(&d)
			var paths []string
			for _, p := range d.Validate() {
				require.Zero(t, p.Line)
				paths = append(paths, p.Path)
			}
			require.Equal(t, tt.paths, paths, "%v", d.Validate())
		})
	}
}

// A payload too deep even for JSON's reader is told the payload's bound,
// not JSON's.
func TestValidateNamesThePayloadsDepthBound(t *testing.T) {
	t.Parallel()
	d := job.Definition{Name: "a", Type: "t", MaxAttempts: 1, Source: &job.Source{Kind: "cron", Schedule: "@daily"},
		Payload: json.RawMessage(`{"a":` + strings.Repeat("[", 10001) + strings.Repeat("]", 10001) + `}`)}
	ps := d.Validate()
	require.Len(t, ps, 1)
	require.Contains(t, ps[0].Message, fmt.Sprintf("at most %d are allowed", task.MaxJSONDepth))
}

func utc(s string) time.Time {
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		panic(err)
	}
	return t.UTC()
}

func TestSchedule(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		spec, tz, after string
		want            []string // the next ticks, in UTC
	}{
		{"0 2 * * *", "", "2024-01-10T12:00:00Z", []string{"2024-01-11T02:00:00Z", "2024-01-12T02:00:00Z"}},
		{"*/20 * * * * *", "UTC", "2024-01-10T12:00:05Z", []string{"2024-01-10T12:00:20Z", "2024-01-10T12:00:40Z", "2024-01-10T12:01:00Z"}},
		{"@every 1s", "", "2024-01-10T12:00:00.5Z", []string{"2024-01-10T12:00:01Z", "2024-01-10T12:00:02Z"}},
		{"@hourly", "Asia/Kolkata", "2024-01-10T12:10:00Z", []string{"2024-01-10T12:30:00Z", "2024-01-10T13:30:00Z"}},
		// Paris is UTC+1 in winter and UTC+2 in summer.
		{"0 2 * * *", "Europe/Paris", "2024-01-10T12:00:00Z", []string{"2024-01-11T01:00:00Z"}},
		{"0 2 * * *", "Europe/Paris", "2024-07-10T12:00:00Z", []string{"2024-07-11T00:00:00Z"}},
		{" @daily ", "Europe/Paris", "2024-07-10T12:00:00Z", []string{"2024-07-10T22:00:00Z"}},
		{"0 0 29 2 *", "", "2024-03-01T00:00:00Z", []string{"2028-02-29T00:00:00Z"}},
	} {
		t.Run(tt.spec+" "+tt.tz, func(t *testing.T) {
			t.Parallel()
			s, err := job.Schedule(tt.spec, tt.tz)
			require.NoError(t, err)
			var got []string
			at := utc(tt.after)
			if strings.Contains(tt.after, ".") {
				at, _ = time.Parse(time.RFC3339Nano, tt.after)
			}
			for range tt.want {
				at = s.Next(at)
				got = append(got, at.UTC().Format(time.RFC3339))
			}
			require.Equal(t, tt.want, got)
		})
	}
}

func TestScheduleRefuses(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ spec, tz, msg string }{
		{"", "", "schedule is empty"},
		{"* * * *", "", "expected 5 to 6 fields, found 4"},
		{"0 0 * * * * *", "", "expected 5 to 6 fields, found 7"},
		{"61 * * * *", "", "end of range (61) above maximum (59)"},
		{"@often", "", "unrecognized descriptor"},
		{"@every 500ms", "", "at least 1s"},
		{"@every -1m", "", "at least 1s"},
		{"@every 1.5s", "", "whole number of seconds"},
		{"@every soon", "", "not a duration"},
		{"TZ=UTC 0 * * * *", "", "timezone field"},
		{"CRON_TZ=UTC", "", "timezone field"},
		{"0 0 30 2 *", "", "never fires"},
		{"@daily", "Europe/Pariss", `unknown timezone "Europe/Pariss"`},
		{"@daily", "Local", `timezone "Local" is not allowed`},
	} {
		_, err := job.Schedule(tt.spec, tt.tz)
		require.ErrorContains(t, err, tt.msg, "%q", tt.spec)
	}
}

// On the day New York springs forward, 02:30 does not exist: the tick
// comes as the clocks jump past it, at 03:30. On the day it falls back,
// 01:30 happens twice: the tick is the first one only. A schedule that runs
// every hour keeps real hours: none in the gap, both of the repeated one.
func TestScheduleDaylightSaving(t *testing.T) {
	t.Parallel()
	ny, err := time.LoadLocation("America/New_York")
	require.NoError(t, err)

	s, err := job.Schedule("30 2 * * *", "America/New_York")
	require.NoError(t, err)
	ticks, more := job.Ticks(s, time.Date(2024, 3, 9, 12, 0, 0, 0, ny), time.Date(2024, 3, 12, 12, 0, 0, 0, ny), 10)
	require.False(t, more)
	require.Equal(t, []time.Time{utc("2024-03-10T07:30:00Z"), utc("2024-03-11T06:30:00Z"), utc("2024-03-12T06:30:00Z")}, inUTC(ticks))
	latest, ok := job.Latest(s, utc("2024-03-10T07:30:00Z"), utc("2024-03-10T12:00:00Z"))
	require.True(t, ok)
	require.Equal(t, utc("2024-03-10T07:30:00Z"), latest.UTC())

	s, err = job.Schedule("30 1 * * *", "America/New_York")
	require.NoError(t, err)
	ticks, _ = job.Ticks(s, time.Date(2024, 11, 2, 12, 0, 0, 0, ny), time.Date(2024, 11, 4, 12, 0, 0, 0, ny), 10)
	require.Equal(t, []time.Time{utc("2024-11-03T05:30:00Z"), utc("2024-11-04T06:30:00Z")}, inUTC(ticks))
	// From inside the repeated hour, as a cursor stored before may stand.
	require.Equal(t, utc("2024-11-04T06:30:00Z"), s.Next(utc("2024-11-03T06:00:00Z")).UTC())

	// Seconds first, and several hours a day.
	s, err = job.Schedule("0 30 1,2,3 * * *", "America/New_York")
	require.NoError(t, err)
	ticks, _ = job.Ticks(s, time.Date(2024, 3, 10, 0, 0, 0, 0, ny), time.Date(2024, 3, 10, 12, 0, 0, 0, ny), 10)
	require.Equal(t, []time.Time{utc("2024-03-10T06:30:00Z"), utc("2024-03-10T07:30:00Z")}, inUTC(ticks),
		"02:30 and 03:30 are the same moment that day: one tick")
	ticks, _ = job.Ticks(s, time.Date(2024, 11, 3, 0, 0, 0, 0, ny), time.Date(2024, 11, 3, 12, 0, 0, 0, ny), 10)
	require.Equal(t, []time.Time{utc("2024-11-03T05:30:00Z"), utc("2024-11-03T07:30:00Z"), utc("2024-11-03T08:30:00Z")}, inUTC(ticks))

	s, err = job.Schedule("30 * * * *", "America/New_York")
	require.NoError(t, err)
	ticks, _ = job.Ticks(s, utc("2024-11-03T04:00:00Z"), utc("2024-11-03T08:00:00Z"), 10)
	require.Equal(t, []time.Time{utc("2024-11-03T04:30:00Z"), utc("2024-11-03T05:30:00Z"), utc("2024-11-03T06:30:00Z"),
		utc("2024-11-03T07:30:00Z")}, inUTC(ticks))
	ticks, _ = job.Ticks(s, utc("2024-03-10T05:00:00Z"), utc("2024-03-10T08:00:00Z"), 10)
	require.Equal(t, []time.Time{utc("2024-03-10T05:30:00Z"), utc("2024-03-10T06:30:00Z"), utc("2024-03-10T07:30:00Z")}, inUTC(ticks))
}

// Through a year of clock changes in zones that change at 02:00, at
// midnight (Santiago) or by half an hour (Lord Howe), a daily schedule
// ticks once on each local date, and its ticks keep their order.
func TestScheduleDailyTicksOncePerDay(t *testing.T) {
	t.Parallel()
	for _, tz := range []string{"America/New_York", "Europe/Paris", "America/Santiago", "Australia/Lord_Howe"} {
		loc, err := time.LoadLocation(tz)
		require.NoError(t, err)
		for _, spec := range []string{"0 0 * * *", "30 1 * * *", "30 2 * * *", "15 0 2 * * *"} {
			s, err := job.Schedule(spec, tz)
			require.NoError(t, err)
			from := time.Date(2024, 1, 1, 12, 0, 0, 0, loc)
			ticks, more := job.Ticks(s, from, from.AddDate(1, 0, 0), 1000)
			require.False(t, more)
			days := map[string]int{}
			for i, tk := range ticks {
				days[tk.In(loc).Format(time.DateOnly)]++
				if i > 0 {
					require.True(t, tk.After(ticks[i-1]))
				}
			}
			require.Len(t, days, 366, "%s in %s: a tick every day", spec, tz)
			for d, n := range days {
				require.Equal(t, 1, n, "%s in %s on %s", spec, tz, d)
			}
		}
	}
}

func inUTC(ts []time.Time) []time.Time {
	out := make([]time.Time, len(ts))
	for i, t := range ts {
		out[i] = t.UTC()
	}
	return out
}

func TestTicks(t *testing.T) {
	t.Parallel()
	s, err := job.Schedule("@every 1s", "")
	require.NoError(t, err)
	start := utc("2024-01-10T12:00:00Z")

	ticks, more := job.Ticks(s, start, start.Add(5*time.Second), 100)
	require.False(t, more)
	require.Len(t, ticks, 5)
	require.Equal(t, start.Add(time.Second), ticks[0], "after is excluded")
	require.Equal(t, start.Add(5*time.Second), ticks[4], "until is included")

	ticks, more = job.Ticks(s, start, start.Add(5*time.Second), 3)
	require.True(t, more)
	require.Equal(t, []time.Time{start.Add(time.Second), start.Add(2 * time.Second), start.Add(3 * time.Second)}, ticks)

	ticks, more = job.Ticks(s, start, start.Add(3*time.Second), 3)
	require.False(t, more, "exactly limit ticks leave nothing out")
	require.Len(t, ticks, 3)

	ticks, more = job.Ticks(s, start, start, 3)
	require.False(t, more)
	require.Empty(t, ticks)

	ticks, more = job.Ticks(s, start, start.Add(time.Hour), 0)
	require.True(t, more)
	require.Empty(t, ticks)

	daily, err := job.Schedule("0 2 * * *", "Europe/Paris")
	require.NoError(t, err)
	ticks, more = job.Ticks(daily, utc("2024-03-30T00:00:00Z"), utc("2024-04-01T00:00:00Z"), 10)
	require.False(t, more)
	// Paris springs forward at 02:00 on 31 March: that day has no 02:00,
	// and ticks as the clocks jump, at 03:00.
	require.Equal(t, []time.Time{utc("2024-03-30T01:00:00Z"), utc("2024-03-31T01:00:00Z"), utc("2024-04-01T00:00:00Z")}, inUTC(ticks))
}

func TestHash(t *testing.T) {
	t.Parallel()
	base := job.Definition{
		Name: "a", Type: "t", Payload: json.RawMessage(`{"x": 1, "y": {"b": 2, "a": [1, 2]}}`), Priority: 5,
		Source:      &job.Source{Kind: "cron", Schedule: "@daily"},
		MaxAttempts: 3, Active: true,
	}
	h := base.Hash()
	require.Len(t, h, 64)

	same := base
	same.Payload = json.RawMessage(`{"y":{"a":[1,2],"b":2},"x":1}`)
	same.Source = &job.Source{Kind: "cron", Schedule: "@daily", Timezone: "UTC", Missed: "run_once"}
	require.Equal(t, h, same.Hash(), "key order, white space and spelled-out defaults do not count")

	parsed, err := job.Parse([]byte("jobs:\n- name: a\n  type: t\n  payload: {y: {b: 2, a: [1, 2]}, x: 1}\n  source: {kind: cron, schedule: '@daily'}\n"))
	require.NoError(t, err)
	require.Equal(t, h, parsed.Jobs[0].Hash(), "a parsed definition hashes as the one built in Go")

	seen := map[string]string{h: "base"}
	for name, edit := range map[string]func(*job.Definition){
		"name":                      func(d *job.Definition) { d.Name = "b" },
		"type":                      func(d *job.Definition) { d.Type = "u" },
		"payload":                   func(d *job.Definition) { d.Payload = json.RawMessage(`{"x":2,"y":{"a":[1,2],"b":2}}`) },
		"priority":                  func(d *job.Definition) { d.Priority = 0 },
		"no source":                 func(d *job.Definition) { d.Source = nil },
		"source.kind":               func(d *job.Definition) { d.Source.Kind = "other" },
		"source.schedule":           func(d *job.Definition) { d.Source.Schedule = "@hourly" },
		"source.timezone":           func(d *job.Definition) { d.Source.Timezone = "Europe/Paris" },
		"source.missed":             func(d *job.Definition) { d.Source.Missed = "skip" },
		"max_attempts":              func(d *job.Definition) { d.MaxAttempts = 4 },
		"timeout_seconds":           func(d *job.Definition) { d.TimeoutSeconds = 1 },
		"heartbeat_timeout_seconds": func(d *job.Definition) { d.HeartbeatTimeoutSeconds = 1 },
		"max_concurrency":           func(d *job.Definition) { d.MaxConcurrency = 1 },
		"max_concurrency_per_key":   func(d *job.Definition) { d.MaxConcurrencyPerKey = 1 },
		"active":                    func(d *job.Definition) { d.Active = false },
		"invalid payload":           func(d *job.Definition) { d.Payload = json.RawMessage(`{"x":`) },
	} {
		d := base
		s := *base.Source
		d.Source = &s
		edit(&d)
		got := d.Hash()
		prev, dup := seen[got]
		require.False(t, dup, "%s hashes like %s", name, prev)
		seen[got] = name
	}
}

func TestDiff(t *testing.T) {
	t.Parallel()
	current := job.File{
		Jobs: []job.Definition{
			{Name: "cleanup", Type: "files.clean", Payload: json.RawMessage(`{"b":1, "a":2}`), Priority: 5, MaxAttempts: 3, Active: true},
			{Name: "old-thing", Type: "x", Priority: 5, MaxAttempts: 3, Active: true},
			{Name: "sync", Type: "crm.sync", Priority: 5, MaxAttempts: 3, Active: true, TimeoutSeconds: 600,
				Source: &job.Source{Kind: "cron", Schedule: "@every 1m"}},
		},
		Types: []job.TypeLimit{{Type: "emails.send", MaxConcurrency: 10}, {Type: "old.type", MaxConcurrency: 1}},
	}
	desired, err := job.Parse([]byte(`
jobs:
  - name: sync
    type: crm.sync
    priority: 7
    source: {kind: cron, schedule: "@every 30s"}
  - name: nightly-report
    type: reports.build
    payload: {format: pdf}
    source: {kind: cron, schedule: "0 2 * * *", timezone: Europe/Paris}
  - name: cleanup
    type: files.clean
    payload: {a: 2, b: 1}
  - name: paused
    type: reports.build
    active: false
types:
  - type: emails.send
    max_concurrency: 20
    max_concurrency_per_key: 2
  - type: batch.run
`))
	require.NoError(t, err)

	changes := job.Diff(current, desired, false)
	require.Equal(t, []job.Change{
		{Op: job.OpUnchanged, Kind: "job", Name: "cleanup"},
		{Op: job.OpCreate, Kind: "job", Name: "nightly-report", Fields: []job.FieldChange{
			{Field: "type", New: "reports.build"},
			{Field: "payload", New: `{"format":"pdf"}`},
			{Field: "priority", New: "5"},
			{Field: "source.kind", New: "cron"},
			{Field: "source.schedule", New: "0 2 * * *"},
			{Field: "source.timezone", New: "Europe/Paris"},
			{Field: "source.missed", New: "run_once"},
			{Field: "max_attempts", New: "3"},
			{Field: "active", New: "true"},
		}},
		{Op: job.OpCreate, Kind: "job", Name: "paused", Fields: []job.FieldChange{
			{Field: "type", New: "reports.build"},
			{Field: "payload", New: `{}`},
			{Field: "priority", New: "5"},
			{Field: "max_attempts", New: "3"},
			{Field: "active", New: "false"},
		}},
		{Op: job.OpUpdate, Kind: "job", Name: "sync", Fields: []job.FieldChange{
			{Field: "priority", Old: "5", New: "7"},
			{Field: "source.schedule", Old: "@every 1m", New: "@every 30s"},
			{Field: "timeout_seconds", Old: "600", New: ""},
		}},
		{Op: job.OpCreate, Kind: "type", Name: "batch.run"},
		{Op: job.OpUpdate, Kind: "type", Name: "emails.send", Fields: []job.FieldChange{
			{Field: "max_concurrency", Old: "10", New: "20"},
			{Field: "max_concurrency_per_key", Old: "", New: "2"},
		}},
	}, changes)

	require.Equal(t, `= job cleanup
+ job nightly-report (reports.build, cron "0 2 * * *" Europe/Paris)
+ job paused (reports.build, inactive)
~ job sync: priority 5 → 7, source.schedule "@every 1m" → "@every 30s", timeout_seconds 600 → none
+ type batch.run (no limits)
~ type emails.send: max_concurrency 10 → 20, max_concurrency_per_key none → 2
`, job.Format(changes))

	pruned := job.Diff(current, desired, true)
	require.Equal(t, `= job cleanup
+ job nightly-report (reports.build, cron "0 2 * * *" Europe/Paris)
- job old-thing
+ job paused (reports.build, inactive)
~ job sync: priority 5 → 7, source.schedule "@every 1m" → "@every 30s", timeout_seconds 600 → none
+ type batch.run (no limits)
~ type emails.send: max_concurrency 10 → 20, max_concurrency_per_key none → 2
- type old.type
`, job.Format(pruned))

	require.Equal(t, []job.Change{
		{Op: job.OpDelete, Kind: "job", Name: "cleanup"},
		{Op: job.OpDelete, Kind: "job", Name: "old-thing"},
		{Op: job.OpDelete, Kind: "job", Name: "sync"},
		{Op: job.OpDelete, Kind: "type", Name: "emails.send"},
		{Op: job.OpDelete, Kind: "type", Name: "old.type"},
	}, job.Diff(current, job.File{}, true), "an empty file with prune deletes everything")
	require.Empty(t, job.Diff(current, job.File{}, false), "an empty file without prune changes nothing")
	require.Empty(t, job.Format(nil))
}

func TestFormatSourceChanges(t *testing.T) {
	t.Parallel()
	current := job.File{Jobs: []job.Definition{{Name: "a", Type: "t", MaxAttempts: 3, Active: true}}}
	desired := job.File{Jobs: []job.Definition{{Name: "a", Type: "t", MaxAttempts: 3, Active: true, Payload: json.RawMessage(`{"k":"v"}`),
		Source: &job.Source{Kind: "cron", Schedule: "@hourly", Timezone: "Asia/Tokyo"}}}}
	require.Equal(t, `~ job a: payload {} → {"k":"v"}, source.kind none → "cron", source.schedule none → "@hourly", source.timezone none → "Asia/Tokyo", source.missed none → "run_once"
`, job.Format(job.Diff(current, desired, false)))
	require.Equal(t, `~ job a: payload {"k":"v"} → {}, source.kind "cron" → none, source.schedule "@hourly" → none, source.timezone "Asia/Tokyo" → none, source.missed "run_once" → none
`, job.Format(job.Diff(desired, current, false)))
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(fullFile))
	f.Add([]byte(`{"jobs":[{"name":"a","type":"t","payload":{"x":[1,{"y":null}]}}]}`))
	f.Add([]byte("jobs:\n  - &a {name: a, type: t}\n  - <<: [*a, *a]\n    name: b\n"))
	f.Add([]byte("a: &a [*a]\n"))
	f.Add([]byte(etlFile))
	f.Add([]byte(diamondFile))
	f.Add([]byte("jobs: [{name: a, type: t}]\nworkflows:\n  - name: w\n    nodes:\n      - {job: a, depends_on: [b]}\n      - {name: b, job: a, depends_on: [a, 5]}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := job.Parse(data)
		if err != nil {
			var ps job.Problems
			require.True(t, errors.As(err, &ps))
			require.NotEmpty(t, ps)
			return
		}
		require.Empty(t, file.Validate(), "what Parse accepts, Validate accepts")
		for _, d := range file.Jobs {
			require.Equal(t, d, d.Normalized(), "Parse returns normalised definitions")
		}
		for _, w := range file.Workflows {
			require.Equal(t, w, w.Normalized(), "Parse returns normalised workflows")
			require.Len(t, w.Order(), len(w.Nodes))
		}
	})
}

func FuzzSchedule(f *testing.F) {
	for _, s := range []string{"0 2 * * *", "*/5 * * * * *", "@every 1h", "@yearly", "0-59/0 * * * *", "TZ=", "? ? ? ? ?", "L W * * *"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		s, err := job.Schedule(spec, "Europe/Paris")
		if err != nil {
			return
		}
		start := time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
		ticks, _ := job.Ticks(s, start, start.AddDate(1, 0, 0), 3)
		for i, tk := range ticks {
			require.True(t, tk.After(start))
			if i > 0 {
				require.True(t, tk.After(ticks[i-1]))
			}
		}
	})
}

// A resumed job's cursor skips the ticks of its pause (missed: skip) or
// keeps the latest of them (run_once), found without walking every tick
// of a long pause, also across a fall-back's repeated hour.
func TestResumeCursor(t *testing.T) {
	t.Parallel()
	now := utc("2024-11-03T12:00:00.5Z")
	cursor := utc("2024-10-03T12:00:00Z") // paused for a month

	every, err := job.Schedule("@every 7s", "")
	require.NoError(t, err)
	latest := job.ResumeCursor(every, cursor, now, job.MissedRunOnce)
	require.False(t, latest.After(now))
	require.Greater(t, latest.Add(7*time.Second), now, "the latest tick of the pause")
	require.Zero(t, latest.Sub(cursor)%(7*time.Second), "one of the cursor's ticks")
	require.Equal(t, every.Next(now), job.ResumeCursor(every, cursor, now, job.MissedSkip), "skip: the next tick after now")

	secondly, err := job.Schedule("* * * * * *", "")
	require.NoError(t, err)
	require.Equal(t, utc("2024-11-03T12:00:00Z"), job.ResumeCursor(secondly, cursor, now, job.MissedRunOnce))
	require.Equal(t, utc("2024-11-03T12:00:01Z"), job.ResumeCursor(secondly, cursor, now, job.MissedSkip))

	// New York's 01:30 happens twice on 3 November: it ticks at the
	// first, in daylight time.
	ny, err := job.Schedule("30 1 * * *", "America/New_York")
	require.NoError(t, err)
	require.Equal(t, utc("2024-11-03T05:30:00Z"), job.ResumeCursor(ny, cursor, now, job.MissedRunOnce).UTC())
	require.Equal(t, utc("2024-11-04T06:30:00Z"), job.ResumeCursor(ny, cursor, now, job.MissedSkip).UTC())

	// Only one tick passed: the cursor stays; none passed: likewise.
	require.Equal(t, utc("2024-11-03T05:30:00Z"), job.ResumeCursor(ny, utc("2024-11-03T05:30:00Z"), now, job.MissedRunOnce).UTC())
	ahead := now.Add(time.Hour)
	require.Equal(t, ahead, job.ResumeCursor(ny, ahead, now, job.MissedSkip))
}
