package httpapi

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-json-experiment/json/jsontext"

	"github.com/conveyorhq/conveyor/internal/task"
)

// decode reads one JSON value from the request body into dst: the body must
// be application/json, no larger than the limit, known fields only, and
// nothing after the value.
func (s *server) decode(w http.ResponseWriter, r *http.Request, dst any) error {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
		return task.Errorf(task.ErrCodeUnsupportedMedia, "Content-Type must be application/json, got %q", r.Header.Get("Content-Type"))
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		return decodeError(err, nil, s.cfg.MaxBodyBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return decodeError(err, body, s.cfg.MaxBodyBytes)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return task.Errorf(task.ErrCodeMalformed, "request body must hold a single JSON value")
	}
	return duplicateNames(body, reflect.TypeOf(dst))
}

// duplicateNames refuses a body whose object names a member twice, which
// the decoder above takes silently, keeping the last: {"type": "a",
// "type": "b"} is no submission of either. The decoder also takes a name
// for the field it matches only when case is ignored, so in the objects
// of t's structs (not in a payload's) names that differ only in case are
// one field given twice too: {"dedupe": true, "Dedupe": false}.
//
// It also refuses a string of invalid UTF-8 or with an unpaired UTF-16
// surrogate escape ("\ud800"), which the decoder turns into U+FFFD
// without a word: a key's name or a user's subject would be stored as
// other text than was sent. The rest of the body's text was the
// decoder's to report, and was.
func duplicateNames(body []byte, t reflect.Type) error {
	dec := jsontext.NewDecoder(bytes.NewReader(body))
	err := sameFields(dec, t)
	var serr *jsontext.SyntacticError
	var twice *task.Error
	switch {
	case errors.As(err, &twice):
		return twice
	case errors.As(err, &serr) && errors.Is(serr.Err, jsontext.ErrDuplicateName):
		return task.Invalid(fieldPath(serr.JSONPointer), "is given twice")
	case errors.As(err, &serr):
		return task.Invalid(cmp.Or(fieldPath(serr.JSONPointer), "body"),
			"holds a string that is not valid text: invalid UTF-8, or an unpaired UTF-16 surrogate escape such as \\ud800")
	}
	return nil
}

// fieldPath is a JSON pointer as the problems name fields: tasks.1.type.
func fieldPath(p jsontext.Pointer) string {
	return strings.ReplaceAll(strings.TrimPrefix(string(p), "/"), "/", ".")
}

var unmarshaler = reflect.TypeFor[json.Unmarshaler]()

// sameFields reads the next value of dec, which the decoder read into a
// value of type t, and refuses two members of one of its structs' objects
// that name the same field. Errors of the JSON text itself are the
// decoder's to report, and were.
func sameFields(dec *jsontext.Decoder, t reflect.Type) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case reflect.PointerTo(t).Implements(unmarshaler):
	case t.Kind() == reflect.Struct && dec.PeekKind() == '{':
		fields := jsonFields(t)
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		named := map[string]bool{}
		for dec.PeekKind() == '"' {
			tok, err := dec.ReadToken()
			if err != nil {
				return err
			}
			field := fieldNamed(fields, tok.String())
			if field == "" {
				err = dec.SkipValue()
			} else if named[field] {
				return task.Invalid(fieldPath(dec.StackPointer()), "is given twice")
			} else {
				named[field] = true
				err = sameFields(dec, fields[field])
			}
			if err != nil {
				return err
			}
		}
		_, err := dec.ReadToken()
		return err
	case t.Kind() == reflect.Slice && dec.PeekKind() == '[':
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		for k := dec.PeekKind(); k != ']' && k != 0; k = dec.PeekKind() {
			if err := sameFields(dec, t.Elem()); err != nil {
				return err
			}
		}
		_, err := dec.ReadToken()
		return err
	}
	return dec.SkipValue()
}

// fieldsOf caches jsonFields by type: a batch reads one struct per entry.
var fieldsOf sync.Map

// jsonFields are the fields of struct type t as encoding/json names them,
// with their types, those of embedded structs included.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	if m, ok := fieldsOf.Load(t); ok {
		return m.(map[string]reflect.Type)
	}
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case tag == "-":
		case f.Anonymous && tag == "" && f.Type.Kind() == reflect.Struct:
			for name, ft := range jsonFields(f.Type) {
				if _, ok := out[name]; !ok {
					out[name] = ft
				}
			}
		case !f.IsExported():
		case tag == "":
			out[f.Name] = f.Type
		default:
			out[tag] = f.Type
		}
	}
	fieldsOf.Store(t, out)
	return out
}

// fieldNamed is the field that encoding/json reads a member called name
// into: the one of that name, else one whose name differs only in case;
// "" for none.
func fieldNamed(fields map[string]reflect.Type, name string) string {
	if _, ok := fields[name]; ok {
		return name
	}
	for f := range fields {
		if strings.EqualFold(f, name) {
			return f
		}
	}
	return ""
}

// hasBody reports whether r carries a body, for a route whose body is
// optional: a body of no declared length (chunked) may be empty too.
func hasBody(r *http.Request) bool {
	if r.ContentLength >= 0 {
		return r.ContentLength > 0
	}
	br := bufio.NewReader(r.Body)
	_, err := br.Peek(1)
	r.Body = struct {
		io.Reader
		io.Closer
	}{br, r.Body}
	return !errors.Is(err, io.EOF)
}

// decodeError turns a json decoding failure of body into a clear domain
// error.
func decodeError(err error, body []byte, limit int64) error {
	var (
		maxErr    *http.MaxBytesError
		syntaxErr *json.SyntaxError
		typeErr   *json.UnmarshalTypeError
	)
	switch {
	case errors.As(err, &maxErr):
		return task.Errorf(task.ErrCodeTooLarge, "request body is larger than %d bytes", limit)
	case errors.As(err, &syntaxErr):
		return task.Errorf(task.ErrCodeMalformed, "malformed JSON at byte %d: %v", syntaxErr.Offset, syntaxErr)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return task.Errorf(task.ErrCodeMalformed, "malformed JSON: unexpected end of body")
	case errors.Is(err, io.EOF):
		return task.Errorf(task.ErrCodeMalformed, "request body is empty")
	case errors.As(err, &typeErr):
		// A batch entry embeds the submit request, whose Go name is no
		// field of the body.
		field := strings.ReplaceAll(typeErr.Field, "submitRequest.", "")
		if field == "" {
			field = "body"
		} else if at, ok := locate(body, strings.Split(field, "."), typeErr.Type, ""); ok {
			field = at
		}
		want := jsonKind(typeErr.Type.Kind().String())
		if typeErr.Type == timeType {
			want = "an RFC 3339 time such as 2026-01-02T15:04:05Z"
		}
		return task.Invalid(field, "must be %s, got JSON %s", want, typeErr.Value)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return task.Errorf(task.ErrCodeMalformed, "unknown field %s", strings.TrimPrefix(err.Error(), "json: unknown field "))
	default:
		return task.Errorf(task.ErrCodeMalformed, "malformed JSON: %v", err)
	}
}

// locate finds the value of doc that a type error names by its path of
// members alone (tasks.priority) and type t: the first at that path that
// does not decode as t, named with the index of each array it sits in
// (tasks.3.priority), which in a batch of a thousand entries says which
// one is at fault. at is doc's own name.
func locate(doc []byte, path []string, t reflect.Type, at string) (string, bool) {
	if len(path) == 0 {
		return at, json.Unmarshal(doc, reflect.New(t).Interface()) != nil
	}
	member := func(name string) string {
		if at == "" {
			return name
		}
		return at + "." + name
	}
	dec := jsontext.NewDecoder(bytes.NewReader(doc), jsontext.AllowDuplicateNames(true), jsontext.AllowInvalidUTF8(true))
	switch dec.PeekKind() {
	case '[':
		if _, err := dec.ReadToken(); err != nil {
			return "", false
		}
		for i := 0; dec.PeekKind() != ']' && dec.PeekKind() != 0; i++ {
			v, err := dec.ReadValue()
			if err != nil {
				return "", false
			}
			if found, ok := locate(v, path, t, member(strconv.Itoa(i))); ok {
				return found, true
			}
		}
	case '{':
		if _, err := dec.ReadToken(); err != nil {
			return "", false
		}
		for dec.PeekKind() == '"' {
			tok, err := dec.ReadToken()
			if err != nil {
				return "", false
			}
			name := tok.String()
			v, err := dec.ReadValue()
			if err != nil {
				return "", false
			}
			// The decoder matches a member to its field ignoring case.
			if strings.EqualFold(name, path[0]) {
				if found, ok := locate(v, path[1:], t, member(name)); ok {
					return found, true
				}
			}
		}
	}
	return "", false
}

// jsonTime is an RFC 3339 time in a request body. time.Time's own
// decoding fails with an error that names no field, which decode could
// only call malformed JSON (400); this one fails as a value of the wrong
// kind does, a 422 naming its field.
type jsonTime struct{ time.Time }

var timeType = reflect.TypeFor[time.Time]()

func (t *jsonTime) UnmarshalJSON(b []byte) error {
	if err := t.Time.UnmarshalJSON(b); err != nil {
		value := string(b)
		if len(value) > 64 {
			value = value[:64] + "…"
		}
		return &json.UnmarshalTypeError{Value: value, Type: timeType}
	}
	return nil
}

func jsonKind(goKind string) string {
	switch goKind {
	case "int", "int8", "int16", "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64":
		return "an integer in range"
	case "bool":
		return "a boolean"
	case "string":
		return "a string"
	case "slice":
		return "an array"
	case "struct", "map":
		return "an object"
	default:
		return fmt.Sprintf("of type %s", goKind)
	}
}

// respond writes v as JSON with the status.
func (s *server) respond(w http.ResponseWriter, r *http.Request, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	if err := json.NewEncoder(w).Encode(v); err != nil {
		s.Log.DebugContext(r.Context(), "write response", "error", err)
	}
}
