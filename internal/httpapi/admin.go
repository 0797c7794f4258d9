package httpapi

import (
	"context"
	"encoding/json"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// AdminStore is what the admin routes need: an org's keys, users, roles
// and memberships, each call inside the principal's org.
type AdminStore interface {
	CreateKey(ctx context.Context, p auth.Principal, in auth.KeyInput) (auth.Key, string, error)
	// ListKeys, ListUsers and ListMembers answer a page: at most limit,
	// those after the row after (uuid.Nil: from the first).
	ListKeys(ctx context.Context, p auth.Principal, after uuid.UUID, limit int) ([]auth.Key, error)
	RevokeKey(ctx context.Context, p auth.Principal, id uuid.UUID) (auth.Key, error)
	CreateUser(ctx context.Context, p auth.Principal, in auth.UserInput) (auth.User, error)
	ListUsers(ctx context.Context, p auth.Principal, after uuid.UUID, limit int) ([]auth.User, error)
	SetUserRole(ctx context.Context, p auth.Principal, id uuid.UUID, role auth.Role) (auth.User, error)
	DeleteUser(ctx context.Context, p auth.Principal, id uuid.UUID) error
	CreateRole(ctx context.Context, p auth.Principal, slug, name string) (auth.OrgRole, error)
	ListRoles(ctx context.Context, p auth.Principal) ([]auth.OrgRole, error)
	DeleteRole(ctx context.Context, p auth.Principal, slug string) error
	AddMember(ctx context.Context, p auth.Principal, slug string, user uuid.UUID) error
	RemoveMember(ctx context.Context, p auth.Principal, slug string, user uuid.UUID) error
	ListMembers(ctx context.Context, p auth.Principal, slug string, after uuid.UUID, limit int) ([]auth.User, error)
}

type keyView struct {
	ID         string          `json:"id"`
	Name       string          `json:"name"`
	Role       auth.Role       `json:"role"`
	Prefix     string          `json:"prefix"`
	OrgRoles   []string        `json:"org_roles"`
	CreatedBy  json.RawMessage `json:"created_by,omitempty"`
	CreatedAt  time.Time       `json:"created_at"`
	ExpiresAt  *time.Time      `json:"expires_at,omitempty"`
	LastUsedAt *time.Time      `json:"last_used_at,omitempty"`
	RevokedAt  *time.Time      `json:"revoked_at,omitempty"`
	// Secret is the whole key, in the answer to its creation only.
	Secret string `json:"secret,omitempty"`
}

func toKeyView(k auth.Key) keyView {
	return keyView{ID: k.ID.String(), Name: k.Name, Role: k.Role, Prefix: k.Prefix, OrgRoles: nonNil(k.OrgRoles),
		CreatedBy: k.CreatedBy, CreatedAt: k.CreatedAt, ExpiresAt: k.ExpiresAt, LastUsedAt: k.LastUsedAt,
		RevokedAt: k.RevokedAt}
}

type userView struct {
	ID         string    `json:"id"`
	ExternalID string    `json:"external_id"`
	Email      string    `json:"email,omitempty"`
	Role       auth.Role `json:"role"`
	OrgRoles   []string  `json:"org_roles"`
	CreatedAt  time.Time `json:"created_at"`
}

func toUserView(u auth.User) userView {
	return userView{ID: u.ID.String(), ExternalID: u.ExternalID, Email: u.Email, Role: u.Role,
		OrgRoles: nonNil(u.OrgRoles), CreatedAt: u.CreatedAt}
}

type roleView struct {
	ID        string    `json:"id"`
	Slug      string    `json:"slug"`
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"created_at"`
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func mapSlice[T, V any](in []T, f func(T) V) []V {
	out := make([]V, len(in))
	for i, x := range in {
		out[i] = f(x)
	}
	return out
}

func (s *server) handleWhoami() http.HandlerFunc {
	type response struct {
		Kind     string    `json:"kind"`
		ID       string    `json:"id"`
		Name     string    `json:"name"`
		OrgID    string    `json:"org_id"`
		Org      string    `json:"org"`
		Role     auth.Role `json:"role"`
		OrgRoles []string  `json:"org_roles"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		p := principal(r)
		s.respond(w, r, http.StatusOK, response{Kind: p.Kind, ID: p.ID.String(), Name: p.Name,
			OrgID: p.OrgID.String(), Org: p.OrgSlug, Role: p.Role, OrgRoles: nonNil(p.OrgRoles)})
	}
}

var slugPattern = regexp.MustCompile(task.SlugPattern)

// orgRoles checks and sorts a list of org role slugs.
func orgRoles(field string, roles []string) ([]string, error) {
	for _, r := range roles {
		if !slugPattern.MatchString(r) {
			return nil, task.Invalid(field, "role %q must match %s", r, task.SlugPattern)
		}
	}
	out := slices.Clone(roles)
	slices.Sort(out)
	return slices.Compact(out), nil
}

// name checks a display name: 1 to 200 characters of text.
func name(field, v string) (string, error) {
	v = strings.TrimSpace(v)
	if v == "" || len(v) > 200 || task.CleanText(v, 200) != v {
		return "", task.Invalid(field, "must be 1 to 200 characters of UTF-8 text without NUL")
	}
	return v, nil
}

func (s *server) handleCreateKey() http.HandlerFunc {
	type request struct {
		Name      string    `json:"name"`
		Role      string    `json:"role"`
		OrgRoles  []string  `json:"org_roles"`
		ExpiresAt *jsonTime `json:"expires_at"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		var req request
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		var expires *time.Time
		if req.ExpiresAt != nil {
			expires = &req.ExpiresAt.Time
		}
		in, err := keyInput(req.Name, req.Role, req.OrgRoles, expires)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		k, secret, err := s.Admin.CreateKey(r.Context(), principal(r), in)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		v := toKeyView(k)
		v.Secret = secret
		w.Header().Set("Cache-Control", "no-store")
		s.respond(w, r, http.StatusCreated, v)
	}
}

// latestExpiry bounds a key's expiry a year short of what JSON's RFC 3339
// times can hold (9999), so that the time, read back in any zone, can
// still be written in the answers: else the key is made but its creation's
// answer, the secret in it, and every later listing of the org's keys fail.
var latestExpiry = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)

func keyInput(keyName, role string, roles []string, expires *time.Time) (auth.KeyInput, error) {
	var in auth.KeyInput
	var err error
	if in.Name, err = name("name", keyName); err != nil {
		return in, err
	}
	if in.Role, err = auth.ParseRole(role); err != nil {
		return in, task.Invalid("role", "%v", err)
	}
	if in.OrgRoles, err = orgRoles("org_roles", roles); err != nil {
		return in, err
	}
	if expires != nil && !expires.After(time.Now()) {
		return in, task.Invalid("expires_at", "must be in the future")
	}
	if expires != nil && !expires.Before(latestExpiry) {
		return in, task.Invalid("expires_at", "must be before %s (or absent: a key that never expires)", latestExpiry.Format(time.RFC3339))
	}
	in.ExpiresAt = expires
	return in, nil
}

func (s *server) handleListKeys() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		after, limit, err := adminPage(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		keys, err := s.Admin.ListKeys(r.Context(), principal(r), after, limit+1)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		keys, next := pageOf(keys, limit, func(k auth.Key) string { return encodeCursor(k.ID) })
		resp := map[string]any{"keys": mapSlice(keys, toKeyView)}
		if next != "" {
			resp["next_cursor"] = next
		}
		s.respond(w, r, http.StatusOK, resp)
	}
}

// adminPage reads the limit and cursor of a listing of keys, users or
// members; the cursor is a task listing's kind, the last id of a page.
// The listing is asked for one row more than limit, which says whether
// another page follows.
func adminPage(r *http.Request) (uuid.UUID, int, error) {
	q := r.URL.Query()
	limit, err := limitParam(q, defaultListLimit, maxListLimit)
	if err != nil {
		return uuid.Nil, 0, err
	}
	var after uuid.UUID
	if c := q.Get("cursor"); c != "" {
		if after, err = decodeCursor(c); err != nil {
			return uuid.Nil, 0, err
		}
	}
	return after, limit, nil
}

// userPage is a page of at most limit users, of a listing asked for one
// more: that one says another page follows.
func userPage(field string, users []auth.User, limit int) map[string]any {
	users, next := pageOf(users, limit, func(u auth.User) string { return encodeCursor(u.ID) })
	resp := map[string]any{field: mapSlice(users, toUserView)}
	if next != "" {
		resp["next_cursor"] = next
	}
	return resp
}

func (s *server) handleRevokeKey() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := pathID(r, "id", "key")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		k, err := s.Admin.RevokeKey(r.Context(), principal(r), id)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, toKeyView(k))
	}
}

func (s *server) handleCreateUser() http.HandlerFunc {
	type request struct {
		ExternalID string `json:"external_id"`
		Email      string `json:"email"`
		Role       string `json:"role"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		var req request
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		in := auth.UserInput{ExternalID: req.ExternalID, Email: strings.TrimSpace(req.Email)}
		var err error
		switch {
		case req.ExternalID == "" || len(req.ExternalID) > 255 || task.CleanText(req.ExternalID, 255) != req.ExternalID ||
			strings.TrimSpace(req.ExternalID) != req.ExternalID:
			// The subject is matched as the provider sends it: one blank,
			// or with white space around it, names a user no sign-in finds.
			err = task.Invalid("external_id", "must be the identity provider's subject: 1 to 255 characters of UTF-8 text "+
				"without NUL, and without white space at either end")
		case len(in.Email) > 254 || task.CleanText(in.Email, 254) != in.Email:
			err = task.Invalid("email", "must be at most 254 characters of UTF-8 text without NUL")
		}
		if err == nil {
			in.Role, err = auth.ParseRole(req.Role)
			if err != nil {
				err = task.Invalid("role", "%v", err)
			}
		}
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		u, err := s.Admin.CreateUser(r.Context(), principal(r), in)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusCreated, toUserView(u))
	}
}

func (s *server) handleListUsers() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		after, limit, err := adminPage(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		users, err := s.Admin.ListUsers(r.Context(), principal(r), after, limit+1)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, userPage("users", users, limit))
	}
}

func (s *server) handleUpdateUser() http.HandlerFunc {
	type request struct {
		Role string `json:"role"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := pathID(r, "id", "user")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		var req request
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		role, err := auth.ParseRole(req.Role)
		if err != nil {
			s.writeError(w, r, task.Invalid("role", "%v", err))
			return
		}
		u, err := s.Admin.SetUserRole(r.Context(), principal(r), id, role)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, toUserView(u))
	}
}

func (s *server) handleDeleteUser() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		id, err := pathID(r, "id", "user")
		if err == nil {
			err = s.Admin.DeleteUser(r.Context(), principal(r), id)
		}
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

func (s *server) handleCreateRole() http.HandlerFunc {
	type request struct {
		Slug string `json:"slug"`
		Name string `json:"name"`
	}
	return func(w http.ResponseWriter, r *http.Request) {
		var req request
		if err := s.decode(w, r, &req); err != nil {
			s.writeError(w, r, err)
			return
		}
		if !slugPattern.MatchString(req.Slug) {
			s.writeError(w, r, task.Invalid("slug", "must match %s", task.SlugPattern))
			return
		}
		if req.Name == "" {
			req.Name = req.Slug
		}
		roleName, err := name("name", req.Name)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		role, err := s.Admin.CreateRole(r.Context(), principal(r), req.Slug, roleName)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusCreated, roleView{ID: role.ID.String(), Slug: role.Slug, Name: role.Name, CreatedAt: role.CreatedAt})
	}
}

func (s *server) handleListRoles() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		roles, err := s.Admin.ListRoles(r.Context(), principal(r))
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, map[string]any{"roles": mapSlice(roles, func(role auth.OrgRole) roleView {
			return roleView{ID: role.ID.String(), Slug: role.Slug, Name: role.Name, CreatedAt: role.CreatedAt}
		})})
	}
}

func (s *server) handleDeleteRole() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		slug, err := pathSlug(r)
		if err == nil {
			err = s.Admin.DeleteRole(r.Context(), principal(r), slug)
		}
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

func (s *server) handleListMembers() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		slug, err := pathSlug(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		after, limit, err := adminPage(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		users, err := s.Admin.ListMembers(r.Context(), principal(r), slug, after, limit+1)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		s.respond(w, r, http.StatusOK, userPage("members", users, limit))
	}
}

// handleMember adds (PUT) or removes (DELETE) a membership; both are
// idempotent.
func (s *server) handleMember(add bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		slug, err := pathSlug(r)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		user, err := pathID(r, "user_id", "user")
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		if add {
			err = s.Admin.AddMember(r.Context(), principal(r), slug, user)
		} else {
			err = s.Admin.RemoveMember(r.Context(), principal(r), slug, user)
		}
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

func pathID(r *http.Request, param, what string) (uuid.UUID, error) {
	raw := chi.URLParam(r, param)
	id, err := uuid.Parse(raw)
	if err != nil || len(raw) != 36 {
		return uuid.Nil, task.Errorf(task.ErrCodeMalformed, "%s id %q is not a UUID", what, raw)
	}
	return id, nil
}

func pathSlug(r *http.Request) (string, error) {
	slug := chi.URLParam(r, "slug")
	if !slugPattern.MatchString(slug) {
		return "", task.Errorf(task.ErrCodeMalformed, "role %q is not a role slug (%s)", slug, task.SlugPattern)
	}
	return slug, nil
}
