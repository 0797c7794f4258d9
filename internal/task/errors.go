package task

import (
	"errors"
	"fmt"
)

// Code classifies an Error. Adapters translate their failures into codes at
// their boundary; the HTTP layer maps codes to statuses in one table.
type Code string

// The error codes.
const (
	// ErrCodeInvalid: the request was well formed but breaks a rule.
	ErrCodeInvalid Code = "invalid"
	// ErrCodeMalformed: the request could not be read (bad JSON, unknown field).
	ErrCodeMalformed Code = "malformed"
	// ErrCodeUnsupportedMedia: the request body is not JSON.
	ErrCodeUnsupportedMedia Code = "unsupported_media_type"
	// ErrCodeTooLarge: the request body is over the limit.
	ErrCodeTooLarge Code = "too_large"
	// ErrCodeNotFound: no such task.
	ErrCodeNotFound Code = "not_found"
	// ErrCodeForbidden: the caller may not do this.
	ErrCodeForbidden Code = "forbidden"
	// ErrCodeConflict: the task's status does not allow the operation.
	ErrCodeConflict Code = "conflict"
	// ErrCodeIdempotencyMismatch: an idempotency key was reused for another input.
	ErrCodeIdempotencyMismatch Code = "idempotency_mismatch"
	// ErrCodeUnavailable: a dependency is down; try again.
	ErrCodeUnavailable Code = "unavailable"
	// ErrCodeInternal: a bug or an unexpected failure.
	ErrCodeInternal Code = "internal"
)

// Error is Conveyor's one error type: a code, the field at fault when there
// is one, and a message meant for the client.
type Error struct {
	Code    Code
	Field   string
	Message string
}

func (e *Error) Error() string {
	if e.Field != "" {
		return fmt.Sprintf("%s: %s: %s", e.Code, e.Field, e.Message)
	}
	return fmt.Sprintf("%s: %s", e.Code, e.Message)
}

// Errorf returns an *Error with a formatted message.
func Errorf(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Invalid returns an ErrCodeInvalid error naming the field at fault.
func Invalid(field, format string, args ...any) *Error {
	return &Error{Code: ErrCodeInvalid, Field: field, Message: fmt.Sprintf(format, args...)}
}

// ErrNotFound is returned for an unknown task id.
var ErrNotFound = &Error{Code: ErrCodeNotFound, Message: "task not found"}

// ErrorCode returns the code of the first *Error in err's chain, or
// ErrCodeInternal for any other error.
func ErrorCode(err error) Code {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ErrCodeInternal
}

// ErrFenced is returned by a fenced write that matched no row: the task's
// version moved on (cancel requested, lease expired, taken over).
var ErrFenced = errors.New("task no longer held at this version")
