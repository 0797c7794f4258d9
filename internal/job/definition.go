// Package job reads job definitions: the jobs, workflows and per-type
// limits an organisation declares in a YAML (or JSON) file for `conveyor
// apply`. It
// parses, validates, normalises, hashes and diffs them; it touches no
// database and no network.
package job

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/conveyorhq/conveyor/internal/task"
)

// Defaults and limits of a definition.
const (
	DefaultPriority    = 5
	DefaultMaxAttempts = 3
	DefaultTimezone    = "UTC"

	MaxPriority                = 9
	MaxAttemptsLimit           = 100
	MaxTimeoutSeconds          = 7 * 24 * 60 * 60
	MaxHeartbeatTimeoutSeconds = 24 * 60 * 60
	MaxConcurrencyLimit        = 10000
)

// SourceCron is the only source kind: a cron schedule.
const SourceCron = "cron"

// What a cron source does with the ticks it missed while nothing ran.
const (
	MissedSkip    = "skip"
	MissedRunOnce = "run_once"
)

// Job names follow the task-type rule: short, lowercase, safe in any key.
var namePattern = regexp.MustCompile(task.TypePattern)

// Source says what triggers a job on its own; a job without one runs only
// when triggered.
type Source struct {
	Kind     string `json:"kind"`
	Schedule string `json:"schedule"`
	Timezone string `json:"timezone"` // "UTC" once normalised
	Missed   string `json:"missed"`   // "run_once" once normalised
}

// Definition is one declared job.
type Definition struct {
	Name                    string          `json:"name"`
	Type                    string          `json:"type"`
	Payload                 json.RawMessage `json:"payload"` // canonical JSON object once normalised
	Priority                int             `json:"priority"`
	Source                  *Source         `json:"source,omitempty"`
	MaxAttempts             int             `json:"max_attempts"`
	TimeoutSeconds          int             `json:"timeout_seconds,omitempty"`           // 0 = none
	HeartbeatTimeoutSeconds int             `json:"heartbeat_timeout_seconds,omitempty"` // 0 = none
	MaxConcurrency          int             `json:"max_concurrency,omitempty"`           // 0 = unlimited
	MaxConcurrencyPerKey    int             `json:"max_concurrency_per_key,omitempty"`   // 0 = unlimited
	Active                  bool            `json:"active"`
}

// TypeLimit caps how many tasks of one type run at once in the org; a
// TypeLimit with no limit set removes the limits.
type TypeLimit struct {
	Type                 string `json:"type"`
	MaxConcurrency       int    `json:"max_concurrency,omitempty"`         // 0 = unlimited
	MaxConcurrencyPerKey int    `json:"max_concurrency_per_key,omitempty"` // 0 = unlimited
}

// File is a whole definitions document.
type File struct {
	Jobs      []Definition `json:"jobs"`
	Types     []TypeLimit  `json:"types"`
	Workflows []Workflow   `json:"workflows"`
}

// Normalized returns d with the defaults that an empty value stands for
// filled in: payload {} (and any payload in canonical form), timezone UTC,
// missed run_once, and the schedule trimmed. Numbers are left alone, since
// 0 is a meaningful priority. A payload that is not valid JSON is kept as
// it is, for Validate to report.
func (d Definition) Normalized() Definition {
	if p, err := canonicalPayload(d.Payload); err == nil {
		d.Payload = p
	}
	d.Source = d.Source.normalized()
	return d
}

// normalized returns a copy of s with its defaults filled in (timezone UTC,
// missed run_once) and its schedule trimmed, or nil for no source.
func (s *Source) normalized() *Source {
	if s == nil {
		return nil
	}
	c := *s
	c.Schedule = strings.TrimSpace(c.Schedule)
	if c.Timezone == "" {
		c.Timezone = DefaultTimezone
	}
	if c.Missed == "" {
		c.Missed = MissedRunOnce
	}
	return &c
}

// Hash is the hex SHA-256 of the canonical JSON of the normalised
// definition: two definitions that differ only in payload key order, white
// space or left-out defaults hash the same.
func (d Definition) Hash() string {
	b, err := json.Marshal(d.Normalized())
	if err != nil {
		// Only an invalid payload gets here; hash its raw text apart from
		// the rest so the result still tells definitions apart.
		raw := d.Payload
		d.Payload = nil
		b, _ = json.Marshal(d.Normalized())
		b = append(append(b, 0), raw...)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Validate reports everything wrong with d, with paths relative to d
// ("source.schedule") and no line numbers. Empty timezone, missed and
// payload stand for their defaults; 0 stands for "none" or "unlimited"
// where the field allows it.
func (d Definition) Validate() Problems {
	ps, _ := d.validate()
	return ps
}

// validate is Validate that also returns the payload's length as stored
// (0 when it cannot be stored): a file's check of its payloads together
// reads each once.
func (d Definition) validate() (Problems, int) {
	var ps Problems
	add := func(path string, err error) {
		if err != nil {
			ps = append(ps, Problem{Path: path, Message: err.Error()})
		}
	}
	add("name", checkName("name", d.Name))
	add("type", checkName("type", d.Type))
	_, stored, err := storedPayload(d.Payload)
	add("payload", err)
	add("priority", checkRange("priority", d.Priority, 0, MaxPriority))
	if d.Source != nil {
		ps = append(ps, d.Source.validate().under("source")...)
	}
	add("max_attempts", checkRange("max_attempts", d.MaxAttempts, 1, MaxAttemptsLimit))
	add("timeout_seconds", checkOptional("timeout_seconds", d.TimeoutSeconds, MaxTimeoutSeconds))
	add("heartbeat_timeout_seconds", checkOptional("heartbeat_timeout_seconds", d.HeartbeatTimeoutSeconds, MaxHeartbeatTimeoutSeconds))
	add("max_concurrency", checkOptional("max_concurrency", d.MaxConcurrency, MaxConcurrencyLimit))
	add("max_concurrency_per_key", checkOptional("max_concurrency_per_key", d.MaxConcurrencyPerKey, MaxConcurrencyLimit))
	return ps, stored
}

// validate reports everything wrong with s, a job's or a workflow's
// source, with paths relative to s ("schedule").
func (s *Source) validate() Problems {
	var ps Problems
	add := func(path string, err error) {
		if err != nil {
			ps = append(ps, Problem{Path: path, Message: err.Error()})
		}
	}
	switch s.Kind {
	case "":
		add("kind", errors.New(`"kind" is required: set it to "cron"`))
	case SourceCron:
	default:
		add("kind", fmt.Errorf(`unsupported source kind %q: only "cron" is supported`, s.Kind))
	}
	if strings.TrimSpace(s.Schedule) == "" {
		add("schedule", errors.New(`"schedule" is required`))
	} else {
		// The time zone has its own check; a bad one must not hide a bad
		// schedule, so the schedule is checked in UTC.
		_, err := Schedule(s.Schedule, DefaultTimezone)
		add("schedule", err)
	}
	_, err := location(s.Timezone)
	add("timezone", err)
	switch s.Missed {
	case "", MissedSkip, MissedRunOnce:
	default:
		add("missed", fmt.Errorf(`invalid missed %q: use "skip" or "run_once"`, s.Missed))
	}
	return ps
}

// Validate reports everything wrong with t, with paths relative to t.
func (t TypeLimit) Validate() Problems {
	var ps Problems
	for _, c := range []struct {
		path string
		err  error
	}{
		{"type", checkName("type", t.Type)},
		{"max_concurrency", checkOptional("max_concurrency", t.MaxConcurrency, MaxConcurrencyLimit)},
		{"max_concurrency_per_key", checkOptional("max_concurrency_per_key", t.MaxConcurrencyPerKey, MaxConcurrencyLimit)},
	} {
		if c.err != nil {
			ps = append(ps, Problem{Path: c.path, Message: c.err.Error()})
		}
	}
	return ps
}

// MaxFilePayloadBytes bounds the payloads of a file's jobs together, as
// stored (each is bounded by task.MaxPayloadBytes).
const MaxFilePayloadBytes = task.MaxBatchStoredBytes

// Validate reports everything wrong with f: each job, type limit and
// workflow, names or types declared twice (at the second one), workflow
// nodes naming a job f does not declare, and payloads too large together.

func (f File) Validate() Problems {
	var ps Problems
	names := make(map[string]int, len(f.Jobs))
	stored := 0
	for i, d := range f.Jobs {
		if len(ps) > maxProblems {
			return ps
		}
		prefix := fmt.Sprintf("jobs[%d]", i)
		dps, n := d.validate()
		ps = append(ps, dps.under(prefix)...)
		stored += n
		if first, ok := names[d.Name]; ok && d.Name != "" {
			ps = append(ps, Problem{Path: prefix + ".name", Message: fmt.Sprintf("duplicate job name %q: jobs[%d] already has it", d.Name, first)})
		} else if !ok {
			names[d.Name] = i
		}
	}
	// A YAML alias repeats a payload at no cost in the file, and jsonb
	// writes numbers out in full: a file under the body limit could store
	// gigabytes of jobs, which every read of the jobs answers.
	if stored > MaxFilePayloadBytes {
		ps = append(ps, Problem{Path: "jobs", Message: fmt.Sprintf("the jobs' payloads take %d bytes together as stored, "+
			"more than the limit of %d for a file", stored, MaxFilePayloadBytes)})
	}
	types := make(map[string]int, len(f.Types))
	for i, t := range f.Types {
		if len(ps) > maxProblems {
			return ps
		}
		prefix := fmt.Sprintf("types[%d]", i)
		ps = append(ps, t.Validate().under(prefix)...)
		if first, ok := types[t.Type]; ok && t.Type != "" {
			ps = append(ps, Problem{Path: prefix + ".type", Message: fmt.Sprintf("duplicate type %q: types[%d] already has it", t.Type, first)})
		} else if !ok {
			types[t.Type] = i
		}
	}
	flows := make(map[string]int, len(f.Workflows))
	for i, wf := range f.Workflows {
		if len(ps) > maxProblems {
			return ps
		}
		prefix := fmt.Sprintf("workflows[%d]", i)
		ps = append(ps, wf.Validate().under(prefix)...)
		// A workflow over the node limit is refused for its size alone
		// (Workflow.Validate), not with a problem per node.
		if len(wf.Nodes) <= MaxNodes {
			for j, n := range wf.Nodes {
				// A job name that breaks the name rule is reported as such.
				if _, ok := names[n.Job]; !ok && checkName("job", n.Job) == nil {
					ps = append(ps, Problem{Path: fmt.Sprintf("%s.nodes[%d].job", prefix, j), Message: fmt.Sprintf("unknown job %q: declare it under jobs:", n.Job)})
				}
			}
		}
		if first, ok := flows[wf.Name]; ok && wf.Name != "" {
			ps = append(ps, Problem{Path: prefix + ".name", Message: fmt.Sprintf("duplicate workflow name %q: workflows[%d] already has it", wf.Name, first)})
		} else if !ok {
			flows[wf.Name] = i
		}
	}
	return ps
}

func checkName(field, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%q is required", field)
	case !namePattern.MatchString(s):
		return fmt.Errorf("invalid %s %q: use 1 to 128 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit", field, s)
	}
	return nil
}

func checkRange(field string, v, lo, hi int) error {
	if v < lo || v > hi {
		return fmt.Errorf("%s must be between %d and %d, got %d", field, lo, hi, v)
	}
	return nil
}

// checkOptional checks a field where 0 means "none".
func checkOptional(field string, v, hi int) error {
	if v == 0 {
		return nil
	}
	if err := checkRange(field, v, 1, hi); err != nil {
		return fmt.Errorf("%w (leave it out for no limit)", err)
	}
	return nil
}

// canonicalPayload returns raw as a canonical JSON object ({} when raw is
// empty or null), or says why it cannot be a payload.
func canonicalPayload(raw json.RawMessage) (json.RawMessage, error) {
	c, _, err := storedPayload(raw)
	return c, err
}

// storedPayload is canonicalPayload that also returns the payload's
// length as PostgreSQL stores it.
func storedPayload(raw json.RawMessage) (json.RawMessage, int, error) {
	trimmed := bytes.TrimSpace(raw)
	if len(trimmed) == 0 || bytes.Equal(trimmed, []byte("null")) {
		return json.RawMessage("{}"), 2, nil
	}
	if trimmed[0] != '{' {
		return nil, 0, errors.New("payload must be an object")
	}
	// The depth first: a document too deep for JSON's reader is also too
	// deep for a payload, whose bound is far lower.
	if d := task.Nesting(trimmed); d > task.MaxJSONDepth {
		return nil, 0, fmt.Errorf("payload nests %d levels deep; at most %d are allowed", d, task.MaxJSONDepth)
	}
	if err := task.StorableJSON(trimmed); err != nil {
		return nil, 0, fmt.Errorf("invalid payload: %w", err)
	}
	c, err := task.Canonical(trimmed)
	if err != nil {
		return nil, 0, fmt.Errorf("invalid payload: %w", err)
	}
	// Measured as stored: the canonical form, which is what the job keeps.
	stored, err := task.StoredLen(c)
	if err != nil {
		return nil, 0, fmt.Errorf("invalid payload: %w", err)
	}
	if stored > task.MaxPayloadBytes {
		return nil, 0, fmt.Errorf("payload %w", task.TooLargeStored(stored))
	}
	return c, stored, nil
}

// location loads an IANA time zone; "" is UTC. "Local" is refused: it
// would depend on the machine that runs the scheduler.
func location(name string) (*time.Location, error) {
	if name == "" {
		return time.UTC, nil
	}
	if name == "Local" {
		return nil, errors.New(`timezone "Local" is not allowed: use an IANA name such as "Europe/Paris"`)
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		return nil, fmt.Errorf("unknown timezone %q: use an IANA name such as \"Europe/Paris\"", name)
	}
	return loc, nil
}
