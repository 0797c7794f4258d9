package task

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
)

// Limits of a submission.
const (
	MaxPriority     = 9
	DefaultPriority = 5
	// DefaultMaxAttempts is the max_attempts of a task submitted without
	// one where no configuration says otherwise (a spawned child).
	DefaultMaxAttempts   = 3
	MaxMaxAttempts       = 100
	MaxBatchSize         = 1000
	MaxIdempotencyKeyLen = 255
	MaxTypeLen           = 128
	// MaxDelay bounds how far ahead a task may be scheduled.
	MaxDelay = 366 * 24 * time.Hour
)

// TypePattern is what a task type must match: it names the type's queue
// (conveyor.task.<type>), so it is short, lowercase and safe everywhere.
const TypePattern = `^[a-z0-9][a-z0-9._-]{0,127}$`

var typePattern = regexp.MustCompile(TypePattern)

// Submission is a validated request to create a task.
type Submission struct {
	OrgID uuid.UUID
	Type  string
	// Visibility is sorted and without repeats.
	Visibility     []string
	Payload        json.RawMessage
	Priority       int
	Metadata       json.RawMessage
	MaxAttempts    int
	IdempotencyKey string
	// InputHash identifies the input (type, canonical payload and
	// visibility). It is always computed; Dedupe decides whether it is
	// stored and enforced.
	InputHash string
	Dedupe    bool
	// RequestHash identifies the whole submission (type, payload,
	// metadata, priority, max_attempts, dedupe, run_at or delay, after
	// defaults): an idempotency key answers the same only for the same
	// request. A max_attempts left out is hashed as left out, not as the
	// default, which the operator may change between a request and its
	// retry.
	RequestHash string
	// DefaultedRequestHash is RequestHash with the default max_attempts
	// filled in, as keys bound by earlier versions recorded it: such a
	// key still answers its request.
	DefaultedRequestHash string
	// RunAt, when set, is when the task becomes due; else Delay after
	// the database's now (zero: at once).
	RunAt *time.Time
	Delay time.Duration
	// ConcurrencyKey, Timeout and HeartbeatTimeout: see Task.
	ConcurrencyKey   string
	Timeout          time.Duration
	HeartbeatTimeout time.Duration
	// JobID and ScheduledAt: the job and tick that made the task.
	JobID       *uuid.UUID
	ScheduledAt *time.Time
	// ParentID and ChildKey: the running task that spawns this one, and
	// its key among that task's children.
	ParentID *uuid.UUID
	ChildKey string
	// StoredBytes is the length of the payload and the metadata as
	// PostgreSQL stores them.
	StoredBytes int
}

// SubmitInput is a submission as a client sent it, before defaults and rules.
type SubmitInput struct {
	Type           string
	Payload        json.RawMessage
	Priority       *int
	Metadata       json.RawMessage
	MaxAttempts    *int
	Dedupe         *bool
	IdempotencyKey string
	Visibility     []string
	// RunAt (RFC 3339) or Delay (a duration such as "90s" or "2h30m"):
	// when the task becomes due. At most one; neither means now.
	RunAt *time.Time
	Delay string
	// ConcurrencyKey names the key the task counts against in its job's
	// or type's per-key limit.
	ConcurrencyKey string
	// TimeoutSeconds and HeartbeatTimeoutSeconds: 0 means none.
	TimeoutSeconds          int
	HeartbeatTimeoutSeconds int
}

// Defaults are the values a submission takes when the client leaves them out.
type Defaults struct {
	MaxAttempts int
}

// NewSubmission checks in against the rules, fills defaults and computes the
// input hash. field prefixes the field names in errors ("tasks[3]." for the
// fourth entry of a batch).
func NewSubmission(in SubmitInput, d Defaults, field string) (Submission, error) {
	s := Submission{
		Type:           in.Type,
		Priority:       DefaultPriority,
		MaxAttempts:    d.MaxAttempts,
		IdempotencyKey: in.IdempotencyKey,
		Dedupe:         true,
	}
	if err := ValidateType(in.Type); err != nil {
		err.Field = field + err.Field
		return Submission{}, err
	}
	payload, payloadBytes, err := jsonObject(in.Payload, field+"payload")
	if err != nil {
		return Submission{}, err
	}
	s.Payload = payload
	metadata, metadataBytes, err := jsonObject(in.Metadata, field+"metadata")
	if err != nil {
		return Submission{}, err
	}
	s.Metadata = metadata
	s.StoredBytes = payloadBytes + metadataBytes
	if in.Priority != nil {
		if *in.Priority < 0 || *in.Priority > MaxPriority {
			return Submission{}, Invalid(field+"priority", "must be between 0 and %d, got %d", MaxPriority, *in.Priority)
		}
		s.Priority = *in.Priority
	}
	statedAttempts := 0 // left out
	if in.MaxAttempts != nil {
		statedAttempts = *in.MaxAttempts
		if *in.MaxAttempts < 1 || *in.MaxAttempts > MaxMaxAttempts {
			return Submission{}, Invalid(field+"max_attempts", "must be between 1 and %d, got %d", MaxMaxAttempts, *in.MaxAttempts)
		}
		s.MaxAttempts = *in.MaxAttempts
	}
	if in.Dedupe != nil {
		s.Dedupe = *in.Dedupe
	}
	if k := in.IdempotencyKey; k != "" {
		if len(k) > MaxIdempotencyKeyLen || !printableASCII(k) {
			return Submission{}, Invalid(field+"idempotency_key", "must be 1 to %d printable ASCII characters", MaxIdempotencyKeyLen)
		}
	}
	if s.Visibility, err = visibility(in.Visibility, field+"visibility"); err != nil {
		return Submission{}, err
	}
	if s.RunAt, s.Delay, err = due(in.RunAt, in.Delay, field); err != nil {
		return Submission{}, err
	}
	if err := s.limits(in, field); err != nil {
		return Submission{}, err
	}
	if s.InputHash, err = InputHash(s.Type, s.Payload); err != nil {
		return Submission{}, Invalid(field+"payload", "%v", err)
	}
	if len(s.Visibility) > 0 {
		// A restricted task is another input than the same payload open
		// to all: deduplication must never hand it to someone else.
		sum := sha256.Sum256([]byte(s.InputHash + "\x00" + strings.Join(s.Visibility, ",")))
		s.InputHash = hex.EncodeToString(sum[:])
	}
	if s.RequestHash, err = requestHash(s, statedAttempts); err != nil {
		return Submission{}, Invalid(field+"metadata", "%v", err)
	}
	// Only a key's earlier binding reads the defaulted hash, which differs
	// only when max_attempts was left out.
	s.DefaultedRequestHash = s.RequestHash
	if s.IdempotencyKey != "" && in.MaxAttempts == nil {
		if s.DefaultedRequestHash, err = requestHash(s, s.MaxAttempts); err != nil {
			return Submission{}, Invalid(field+"metadata", "%v", err)
		}
	}
	return s, nil
}

// requestHash is the hex sha256 of everything the client asked for, each
// JSON document in its canonical form, with maxAttempts for max_attempts.
func requestHash(s Submission, maxAttempts int) (string, error) {
	metadata, err := Canonical(s.Metadata)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%s\x00%d\x00%d\x00%t\x00", s.InputHash, metadata, s.Priority, maxAttempts, s.Dedupe)
	if s.RunAt != nil || s.Delay != 0 {
		// Only when asked for, so that requests recorded before delays
		// existed keep their hashes.
		runAt := ""
		if s.RunAt != nil {
			runAt = s.RunAt.UTC().Format(time.RFC3339Nano)
		}
		fmt.Fprintf(h, "%s\x00%d\x00", runAt, s.Delay)
	}
	if s.ConcurrencyKey != "" || s.Timeout != 0 || s.HeartbeatTimeout != 0 {
		fmt.Fprintf(h, "key:%s\x00%d\x00%d\x00", s.ConcurrencyKey, s.Timeout, s.HeartbeatTimeout)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Bounds of the per-task limits.
const (
	MaxConcurrencyKeyLen    = 255
	MaxTimeoutSeconds       = 7 * 24 * 3600
	MaxHeartbeatTimeoutSecs = 24 * 3600
)

// limits checks the concurrency key and the timeouts of a submission.
func (s *Submission) limits(in SubmitInput, field string) error {
	if k := in.ConcurrencyKey; k != "" {
		if len(k) > MaxConcurrencyKeyLen || !printableASCII(k) {
			return Invalid(field+"concurrency_key", "must be 1 to %d printable ASCII characters", MaxConcurrencyKeyLen)
		}
		s.ConcurrencyKey = k
	}
	if n := in.TimeoutSeconds; n < 0 || n > MaxTimeoutSeconds {
		return Invalid(field+"timeout_seconds", "must be between 1 and %d (0 or absent: none), got %d", MaxTimeoutSeconds, n)
	}
	if n := in.HeartbeatTimeoutSeconds; n < 0 || n > MaxHeartbeatTimeoutSecs {
		return Invalid(field+"heartbeat_timeout_seconds", "must be between 1 and %d (0 or absent: none), got %d", MaxHeartbeatTimeoutSecs, n)
	}
	s.Timeout = time.Duration(in.TimeoutSeconds) * time.Second
	s.HeartbeatTimeout = time.Duration(in.HeartbeatTimeoutSeconds) * time.Second
	return nil
}

// due checks when a submission asks its task to become due: at run_at, or
// delay after it is stored.
func due(runAt *time.Time, delay, field string) (*time.Time, time.Duration, error) {
	switch {
	case runAt != nil && delay != "":
		return nil, 0, Invalid(field+"delay", "give run_at or delay, not both")
	case runAt != nil:
		if runAt.After(time.Now().Add(MaxDelay)) {
			return nil, 0, Invalid(field+"run_at", "is more than %d days ahead", int(MaxDelay.Hours()/24))
		}
		t := runAt.UTC()
		return &t, 0, nil
	case delay != "":
		d, err := time.ParseDuration(delay)
		if err != nil || d < 0 {
			return nil, 0, Invalid(field+"delay", "must be a duration of 0 or more such as 90s or 2h30m, got %q", delay)
		}
		if d > MaxDelay {
			return nil, 0, Invalid(field+"delay", "is more than %d days", int(MaxDelay.Hours()/24))
		}
		return nil, d, nil
	}
	return nil, 0, nil
}

// SlugPattern is what org and org role slugs match.
const SlugPattern = `^[a-z0-9][a-z0-9-]{0,62}$`

var slugPattern = regexp.MustCompile(SlugPattern)

// MaxVisibility bounds the roles a task names.
const MaxVisibility = 16

// visibility checks the org role slugs of a submission and returns them
// sorted, without repeats.
func visibility(roles []string, field string) ([]string, error) {
	if len(roles) > MaxVisibility {
		return nil, Invalid(field, "names %d roles; at most %d are allowed", len(roles), MaxVisibility)
	}
	for _, r := range roles {
		if !slugPattern.MatchString(r) {
			return nil, Invalid(field, "role %q must match %s", r, SlugPattern)
		}
	}
	out := slices.Clone(roles)
	slices.Sort(out)
	return slices.Compact(out), nil
}

// ValidateType checks a task type against ^[a-z0-9][a-z0-9._-]{0,127}$.
func ValidateType(typ string) *Error {
	if typ == "" {
		return Invalid("type", "is required")
	}
	if !typePattern.MatchString(typ) {
		return Invalid("type", "must match %s", TypePattern)
	}
	return nil
}

// JSONObject returns raw when it is a JSON object, {} when it is absent, and
// an error naming field otherwise, or when PostgreSQL would store it in
// more than MaxPayloadBytes.
func JSONObject(raw json.RawMessage, field string) (json.RawMessage, error) {
	doc, _, err := jsonObject(raw, field)
	return doc, err
}

// jsonObject is JSONObject that also returns the document's length as
// stored.
func jsonObject(raw json.RawMessage, field string) (json.RawMessage, int, error) {
	trimmed := bytes.TrimSpace(raw)
	if len(trimmed) == 0 || bytes.Equal(trimmed, []byte("null")) {
		return json.RawMessage("{}"), 2, nil
	}
	if trimmed[0] != '{' || !json.Valid(trimmed) {
		return nil, 0, Invalid(field, "must be a JSON object")
	}
	if err := StorableJSON(trimmed); err != nil {
		return nil, 0, Invalid(field, "%v", err)
	}
	d, stored, err := walk(trimmed)
	if d > MaxJSONDepth {
		return nil, 0, Invalid(field, "nests %d levels deep; at most %d are allowed", d, MaxJSONDepth)
	}
	if err != nil {
		return nil, 0, Invalid(field, "%v", err)
	}
	if stored > MaxPayloadBytes {
		return nil, 0, Invalid(field, "%v", TooLargeStored(stored))
	}
	return trimmed, stored, nil
}

// MaxJSONDepth bounds the nesting of payload and metadata: deeper documents
// serve no task and only burden every layer that walks them.
const MaxJSONDepth = 64

// MaxPayloadBytes bounds a payload, the metadata of a task and the params
// of a workflow run, each on its own, as PostgreSQL stores and answers
// them. The request body's limit does not bound them: jsonb writes a
// number out in full, so 1e308 (5 bytes sent) takes 309 and 1e-16383
// 16385, and a body of such numbers would be stored (and answered by
// every read of the task, the worker's claim included) tens or thousands
// of times larger than it was sent.
const MaxPayloadBytes = 1 << 20

// MaxBatchStoredBytes bounds the payloads and metadata of one batch
// together, as stored: each within MaxPayloadBytes, a batch's entries could
// otherwise turn a request of under 1 MiB into a gigabyte written in one
// transaction.
const MaxBatchStoredBytes = 16 << 20

// TooLargeStored is the reason a document of stored bytes as PostgreSQL
// stores it is refused.
func TooLargeStored(stored int) error {
	return fmt.Errorf("takes %d bytes as stored, more than the limit of %d: PostgreSQL writes every number "+
		"out in full (1e300 takes 301 bytes) and puts a space after each comma and colon", stored, MaxPayloadBytes)
}

// StoredLen returns how many bytes PostgreSQL takes to write doc, a valid
// JSON document, as jsonb text (what it stores and answers), or why it
// cannot store it. It is exact for a document without repeated object
// keys (jsonb keeps one of them, so it writes less).
func StoredLen(doc []byte) (int, error) {
	_, n, err := walk(doc)
	return n, err
}

// depth returns how deeply a valid JSON document nests objects and arrays.
func depth(doc []byte) int {
	d, _, _ := walk(doc)
	return d
}

// walk reads a valid JSON document once and returns how deeply it nests
// objects and arrays, its length as jsonb text, and an error for its first
// number beyond a float64's range (about ±1.8e308): most workers cannot
// hold such numbers, and PostgreSQL writes each out in full (1e400 as 401
// digits) or overflows.
func walk(doc []byte) (deepest, stored int, err error) {
	cur := 0
	for i := 0; i < len(doc); i++ {
		c := doc[i]
		switch {
		case c == '"':
			var n int
			n, i = stringLen(doc, i)
			stored += n
		case c == '{' || c == '[':
			cur++
			deepest = max(deepest, cur)
			stored++
		case c == '}' || c == ']':
			cur--
			stored++
		case c == ',' || c == ':':
			stored += 2 // jsonb writes ", " and ": "
		case c == '-' || '0' <= c && c <= '9':
			end, exponent := i, false
			for end < len(doc) && strings.IndexByte("0123456789+-.eE", doc[end]) >= 0 {
				exponent = exponent || doc[end] == 'e' || doc[end] == 'E'
				end++
			}
			if err == nil && (exponent || end-i > 300) { // shorter plain numbers always fit
				if _, perr := strconv.ParseFloat(string(doc[i:end]), 64); perr != nil {
					err = fmt.Errorf("number %.40s is beyond the range of a float64", doc[i:end])
				}
			}
			n, nerr := numericLen(doc[i:end])
			if err == nil && nerr != nil {
				err = nerr
			}
			stored += n
			i = end - 1
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
		default: // the letters of true, false and null
			stored++
		}
	}
	return deepest, stored, err
}

// stringLen returns the length as jsonb writes it of the string that
// starts with the quote at doc[i], and the index of its closing quote.
// jsonb decodes escapes, then writes " and \ escaped, \b \f \n \r \t as
// such and other control characters as \u00XX.
func stringLen(doc []byte, i int) (n, end int) {
	n = 2
	for i++; i < len(doc) && doc[i] != '"'; i++ {
		if doc[i] != '\\' {
			n++
			continue
		}
		i++
		if doc[i] != 'u' {
			if doc[i] == '/' {
				n++
			} else {
				n += 2
			}
			continue
		}
		code := hex4(doc[i+1:])
		i += 4
		switch {
		case code == '"' || code == '\\' || code == '\b' || code == '\f' || code == '\n' || code == '\r' || code == '\t':
			n += 2
		case code < 0x20:
			n += 6
		case code < 0x80:
			n++
		case code < 0x800:
			n += 2
		case code >= 0xD800 && code < 0xDC00 && i+6 < len(doc) && doc[i+1] == '\\' && doc[i+2] == 'u':
			// A surrogate pair is one character of four bytes.
			n += 4
			i += 6
		default:
			n += 3
		}
	}
	return n, i
}

// Limits of PostgreSQL's numeric, which jsonb stores numbers as.
const (
	numericMaxScale  = 16383
	numericMaxDigits = 131072
)

// numericLen returns the length of a JSON number as PostgreSQL's numeric
// writes it: every digit of its integer part and exactly as many after
// the point as the text gives, the exponent applied (1.50e1 is 15.0, 1e-3
// is 0.001), without the sign of a zero.
func numericLen(num []byte) (int, error) {
	neg := num[0] == '-'
	if neg {
		num = num[1:]
	}
	mantissa, expText := num, []byte(nil)
	if k := bytes.IndexAny(num, "eE"); k >= 0 {
		mantissa, expText = num[:k], num[k+1:]
	}
	intPart, frac := mantissa, []byte(nil)
	if k := bytes.IndexByte(mantissa, '.'); k >= 0 {
		intPart, frac = mantissa[:k], mantissa[k+1:]
	}
	exp := 0
	expNeg := len(expText) > 0 && expText[0] == '-'
	for _, c := range bytes.TrimLeft(expText, "+-") {
		if exp < 1<<30 {
			exp = exp*10 + int(c-'0')
		}
	}
	if expNeg {
		exp = -exp
	}
	// Significant digits: the first non-zero one, counted from the start
	// of the integer part.
	first := -1
	for k, c := range intPart {
		if c != '0' {
			first = k
			break
		}
	}
	if first < 0 {
		for k, c := range frac {
			if c != '0' {
				first = len(intPart) + k
				break
			}
		}
	}
	point := len(intPart) + exp // where the point falls among the digits
	scale := max(0, len(frac)-exp)
	intLen := 1
	if first >= 0 && first < point {
		intLen = point - first
	}
	if scale > numericMaxScale || intLen > numericMaxDigits {
		return 0, fmt.Errorf("number %.40s has more digits than PostgreSQL can store", num)
	}
	n := intLen
	if scale > 0 {
		n += 1 + scale
	}
	if neg && first >= 0 {
		n++
	}
	return n, nil
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
