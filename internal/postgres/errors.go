package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/conveyorhq/conveyor/internal/task"
)

// pgCode returns the SQLSTATE of a PostgreSQL error, or "".
func pgCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// Classes of SQLSTATE the adapter reacts to.
const (
	codeDeadlock       = "40P01"
	codeSerialization  = "40001"
	codeNoDatabase     = "3D000"
	codeUndefinedTable = "42P01"
	// codeCheckViolation: a row breaks a CHECK constraint.
	codeCheckViolation = "23514"
	// codeForeignKeyViolation: a row names one that is not there (a
	// concurrent transaction deleted it).
	codeForeignKeyViolation = "23503"
)

// isDataError reports whether PostgreSQL refused a value (class 22: bad
// encoding, an unsupported escape such as \u0000, text it cannot parse; or
// a value a check constraint refuses, such as a result over its bound):
// the input is at fault, not the statement.
func isDataError(err error) bool {
	code := pgCode(err)
	return len(code) == 5 && code[:2] == "22" || code == codeCheckViolation
}

// translate turns driver errors into domain errors at the boundary.
func translate(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return task.ErrNotFound
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == codeCheckViolation && pgErr.ConstraintName == "task_results_payload_size":
			return &task.Error{Code: task.ErrCodeInvalid, Message: fmt.Sprintf("the result is larger than %d bytes "+
				"as stored (the limit of a task's result): store large artefacts elsewhere and return a pointer to them",
				task.MaxResultBytes)}
		case pgErr.Code == codeCheckViolation:
			return &task.Error{Code: task.ErrCodeInvalid, Message: "input breaks a rule: " + pgErr.ConstraintName}
		case isDataError(err):
			return &task.Error{Code: task.ErrCodeInvalid, Message: "input rejected by the database: " + pgErr.Message}
		case pgErr.Code == codeForeignKeyViolation: // a concurrent request removed a row this one names
			return &task.Error{Code: task.ErrCodeNotFound, Message: "not found: what it names was removed meanwhile"}
		case pgErr.Code == "23505": // unique_violation
			return &task.Error{Code: task.ErrCodeConflict, Message: "already exists: " + pgErr.ConstraintName}
		case pgErr.Code == "42501": // insufficient_privilege, row-level security included
			return &task.Error{Code: task.ErrCodeForbidden, Message: "not allowed"}
		case pgErr.Code == "57014": // query_canceled: statement_timeout or a cancelled request
			return &task.Error{Code: task.ErrCodeUnavailable, Message: "the database did not answer in time; try again"}
		case Transient(pgErr): // shutting down, restarting, or a connection lost
			return &task.Error{Code: task.ErrCodeUnavailable, Message: "database unavailable, try again"}
		}
	}
	if pgconn.SafeToRetry(err) || pgconn.Timeout(err) {
		return &task.Error{Code: task.ErrCodeUnavailable, Message: "database unavailable, try again"}
	}
	// A request whose time ran out before it reached PostgreSQL (waiting
	// for a connection of a busy pool, or its turn in a submit group) gets
	// the bare context error, which pgconn.Timeout does not recognise: it
	// is the same slow database, not a bug.
	if errors.Is(err, context.DeadlineExceeded) {
		return &task.Error{Code: task.ErrCodeUnavailable, Message: "the database did not answer in time; try again"}
	}
	return err
}

// Transient reports whether a failure is worth another try: the server is
// starting, restarting or shutting down, or unreachable for now. A missing
// database, refused credentials, a malformed URL or a failing migration are
// not: waiting does not heal them.
func Transient(err error) bool {
	code := pgCode(err)
	switch {
	case code == codeNoDatabase || code == "28P01" || code == "28000":
		return false
	case code == "57P01" || code == "57P02" || code == "57P03" || strings.HasPrefix(code, "08"):
		return true
	case code != "":
		return false
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return pgconn.SafeToRetry(err) || pgconn.Timeout(err) || errors.As(err, &connectErr) || errors.As(err, &netErr) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF)
}

// retryDeadlocks runs f, a transaction, again while PostgreSQL rolls it
// back whole to break a deadlock, up to maxDeadlockTries times. One that
// outlasts them is worth another request, not an internal error: nothing
// was written.
func retryDeadlocks(f func() error) error {
	for try := 1; ; try++ {
		err := f()
		if pgCode(err) != codeDeadlock {
			return err
		}
		if try >= maxDeadlockTries {
			return outlasted(err)
		}
	}
}
