package httpapi

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"

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
		return decodeError(err, s.cfg.MaxBodyBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return decodeError(err, s.cfg.MaxBodyBytes)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return task.Errorf(task.ErrCodeMalformed, "request body must hold a single JSON value")
	}
	return duplicateNames(body)
}

// duplicateNames refuses a body whose object names a member twice, which
// the decoder above takes silently, keeping the last: {"type": "a",
// "type": "b"} is no submission of either.
func duplicateNames(body []byte) error {
	_, err := jsontext.NewDecoder(bytes.NewReader(body), jsontext.AllowInvalidUTF8(true)).ReadValue()
	var serr *jsontext.SyntacticError
	if errors.As(err, &serr) && errors.Is(serr.Err, jsontext.ErrDuplicateName) {
		field := strings.ReplaceAll(strings.TrimPrefix(string(serr.JSONPointer), "/"), "/", ".")
		return task.Invalid(field, "is given twice")
	}
	return nil
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

// decodeError turns a json decoding failure into a clear domain error.
func decodeError(err error, limit int64) error {
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
		}
		return task.Invalid(field, "must be %s, got JSON %s", jsonKind(typeErr.Type.Kind().String()), typeErr.Value)
	case strings.HasPrefix(err.Error(), "json: unknown field "):
		return task.Errorf(task.ErrCodeMalformed, "unknown field %s", strings.TrimPrefix(err.Error(), "json: unknown field "))
	default:
		return task.Errorf(task.ErrCodeMalformed, "malformed JSON: %v", err)
	}
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
