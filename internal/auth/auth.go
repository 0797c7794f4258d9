// Package auth says who a request comes from and what it may do. A caller
// is a Principal — a person known through an OpenID Connect token, or a
// service holding an API key — inside one org, with a role (reader, writer,
// admin) and the org roles that decide which restricted tasks it sees.
// Authenticator turns a bearer token into a Principal; the HTTP adapter
// checks the role a route needs, and hands the store the principal's Scope,
// which the database enforces with row-level security.
package auth

import (
	"errors"
	"fmt"
	"slices"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/task"
)

// Role is what a principal may do in its org. Each role may do everything
// the ones before it may.
type Role string

// The roles, weakest first.
const (
	Reader Role = "reader" // reads tasks, events and results
	Writer Role = "writer" // also submits, cancels and retries
	Admin  Role = "admin"  // also manages users, roles, memberships and keys, and sees every task
)

var rank = map[Role]int{Reader: 1, Writer: 2, Admin: 3}

// ParseRole returns the role s names.
func ParseRole(s string) (Role, error) {
	if _, ok := rank[Role(s)]; !ok {
		return "", fmt.Errorf("role must be one of reader, writer, admin; got %q", s)
	}
	return Role(s), nil
}

// Allows reports whether r may do what need requires.
func (r Role) Allows(need Role) bool { return rank[r] >= rank[need] && rank[r] > 0 }

// The kinds of principal.
const (
	KindUser = "user"
	KindKey  = "key"
	KindDev  = "dev" // everyone, when authentication is off
)

// Principal is an authenticated caller.
type Principal struct {
	Kind    string // KindUser, KindKey or KindDev
	ID      uuid.UUID
	Name    string // the user's email or subject, the key's name
	OrgID   uuid.UUID
	OrgSlug string
	Role    Role
	// OrgRoles are the slugs of the org roles the principal is a member
	// of, sorted.
	OrgRoles []string
}

// Scope is what the principal may see in the database.
func (p Principal) Scope() Scope {
	return Scope{OrgID: p.OrgID, Roles: p.OrgRoles, SeeAll: p.Role == Admin}
}

// Actor is the principal as recorded on the events of its changes.
func (p Principal) Actor() *task.Principal {
	return &task.Principal{Kind: p.Kind, ID: p.ID, Name: p.Name}
}

// MayRestrictTo reports whether the principal may submit a task visible
// only to roles: it must see what it submits, or deduplication and
// idempotency keys would hand it tasks it may not see.
func (p Principal) MayRestrictTo(roles []string) bool {
	if p.Role == Admin {
		return true
	}
	for _, r := range roles {
		if !slices.Contains(p.OrgRoles, r) {
			return false
		}
	}
	return true
}

// Scope is the slice of the database one caller works in: the rows of its
// org, and of those the tasks restricted to roles it holds (all of them
// with SeeAll). The store sets it on every transaction it runs for the
// caller; without it, row-level security shows nothing.
type Scope struct {
	OrgID  uuid.UUID
	Roles  []string
	SeeAll bool
}

// Equal reports whether s and o take in the same tasks: the same org,
// both seeing all of it or both the same roles, in any order.
func (s Scope) Equal(o Scope) bool {
	if s.OrgID != o.OrgID || s.SeeAll != o.SeeAll {
		return false
	}
	if s.SeeAll {
		return true
	}
	a, b := slices.Clone(s.Roles), slices.Clone(o.Roles)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(slices.Compact(a), slices.Compact(b))
}

// Sees reports whether the scope takes in a task of org restricted to
// visibility (no roles: the whole org). It is the row-level security
// policy on tasks (migrations/003_orgs.sql), for rows read outside it.
func (s Scope) Sees(org uuid.UUID, visibility []string) bool {
	if org != s.OrgID || s.OrgID == uuid.Nil {
		return false
	}
	if len(visibility) == 0 || s.SeeAll {
		return true
	}
	for _, r := range visibility {
		if slices.Contains(s.Roles, r) {
			return true
		}
	}
	return false
}

// Reasons an authentication fails, as counted in
// conveyor_auth_failures_total{reason}.
const (
	ReasonMissing     = "missing"       // no Authorization header
	ReasonMalformed   = "malformed"     // not "Bearer <token>", or a token of no known form
	ReasonUnknownKey  = "unknown_key"   // no key with the token's prefix, or a wrong secret
	ReasonRevoked     = "revoked"       // the key was revoked
	ReasonExpired     = "expired"       // the key expired
	ReasonInvalidJWT  = "invalid_token" // signature, issuer, audience or time checks failed
	ReasonUnknownUser = "unknown_user"  // a valid token of a subject that is no user
	ReasonNoOIDC      = "oidc_off"      // a JWT, but no issuer is configured
	ReasonLookup      = "lookup_error"  // the database could not be asked
)

// Error is a failed authentication. Its message is safe to show the caller
// and to log: it never holds the token.
type Error struct {
	Reason  string
	Message string
	// Err is the cause, for logs.
	Err error
}

func (e *Error) Error() string { return e.Message }
func (e *Error) Unwrap() error { return e.Err }

// ReasonOf returns the reason of an authentication error.
func ReasonOf(err error) string {
	var ae *Error
	if errors.As(err, &ae) {
		return ae.Reason
	}
	return ReasonLookup
}

func fail(reason, msg string, cause error) error {
	return &Error{Reason: reason, Message: msg, Err: cause}
}
