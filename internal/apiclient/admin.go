package apiclient

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"time"
)

// Whoami is the caller as the API sees it.
type Whoami struct {
	Document
	Kind     string   `json:"kind"`
	ID       string   `json:"id"`
	Name     string   `json:"name"`
	OrgID    string   `json:"org_id"`
	Org      string   `json:"org"`
	Role     string   `json:"role"`
	OrgRoles []string `json:"org_roles"`
}

// Whoami returns the caller.
func (c *Client) Whoami(ctx context.Context) (Whoami, error) {
	var w Whoami
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/whoami"}, &w)
	return w, err
}

// Key is an API key of the org; Secret only in the answer to its creation.
type Key struct {
	Document
	ID         string          `json:"id"`
	Name       string          `json:"name"`
	Role       string          `json:"role"`
	Prefix     string          `json:"prefix"`
	OrgRoles   []string        `json:"org_roles"`
	CreatedBy  json.RawMessage `json:"created_by,omitempty"`
	CreatedAt  time.Time       `json:"created_at"`
	ExpiresAt  *time.Time      `json:"expires_at,omitempty"`
	LastUsedAt *time.Time      `json:"last_used_at,omitempty"`
	RevokedAt  *time.Time      `json:"revoked_at,omitempty"`
	Secret     string          `json:"secret,omitempty"`
}

// KeyRequest is the body of POST /v1/keys.
type KeyRequest struct {
	Name      string     `json:"name"`
	Role      string     `json:"role"`
	OrgRoles  []string   `json:"org_roles,omitempty"`
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
}

// KeyList is the org's keys, newest first.
type KeyList struct {
	Document
	Keys []Key `json:"keys"`
}

// CreateKey makes a key; the answer holds its secret, shown this once.
func (c *Client) CreateKey(ctx context.Context, in KeyRequest) (Key, error) {
	var k Key
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/keys", body: in}, &k)
	return k, err
}

// Keys lists the org's keys, revoked ones included: every page of them.
func (c *Client) Keys(ctx context.Context) (KeyList, error) {
	var l KeyList
	var err error
	l.Document, err = c.everyPage(ctx, "/v1/keys", "keys", &l.Keys)
	return l, err
}

// everyPage reads a paged listing to its end, following next_cursor, into
// items (a pointer to a slice), and answers one document that holds the
// items of every page under field, as if a single page.
func (c *Client) everyPage(ctx context.Context, path, field string, items any) (Document, error) {
	all := []json.RawMessage{}
	cursor := ""
	for {
		q := url.Values{}
		set(q, "cursor", cursor)
		var page map[string]json.RawMessage
		if _, err := c.do(ctx, request{method: http.MethodGet, path: path, query: q}, &page); err != nil {
			return Document{}, err
		}
		var these []json.RawMessage
		if err := json.Unmarshal(page[field], &these); err != nil {
			return Document{}, fmt.Errorf("GET %s: decode answer: %w", path, err)
		}
		all = append(all, these...)
		var next string
		if raw, ok := page["next_cursor"]; ok {
			if err := json.Unmarshal(raw, &next); err != nil {
				return Document{}, fmt.Errorf("GET %s: decode answer: %w", path, err)
			}
		}
		if next == "" {
			break
		}
		if next == cursor {
			// A server that answers the cursor it was sent would be read forever.
			return Document{}, fmt.Errorf("GET %s: the API answered the cursor it was sent", path)
		}
		cursor = next
	}
	list, err := json.Marshal(all)
	if err != nil {
		return Document{}, err
	}
	if err := json.Unmarshal(list, items); err != nil {
		return Document{}, fmt.Errorf("GET %s: decode answer: %w", path, err)
	}
	body, err := json.Marshal(map[string]json.RawMessage{field: list})
	if err != nil {
		return Document{}, err
	}
	var d Document
	d.keep(body)
	return d, nil
}

// RevokeKey revokes a key.
func (c *Client) RevokeKey(ctx context.Context, id string) (Key, error) {
	var k Key
	_, err := c.do(ctx, request{method: http.MethodDelete, path: "/v1/keys/" + url.PathEscape(id)}, &k)
	return k, err
}

// User is a person of the org.
type User struct {
	Document
	ID         string    `json:"id"`
	ExternalID string    `json:"external_id"`
	Email      string    `json:"email,omitempty"`
	Role       string    `json:"role"`
	OrgRoles   []string  `json:"org_roles"`
	CreatedAt  time.Time `json:"created_at"`
}

// UserRequest is the body of POST /v1/users.
type UserRequest struct {
	ExternalID string `json:"external_id"`
	Email      string `json:"email,omitempty"`
	Role       string `json:"role"`
}

// UserList is the org's users, or a role's members.
type UserList struct {
	Document
	Users   []User `json:"users,omitempty"`
	Members []User `json:"members,omitempty"`
}

// CreateUser adds a person to the org.
func (c *Client) CreateUser(ctx context.Context, in UserRequest) (User, error) {
	var u User
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/users", body: in}, &u)
	return u, err
}

// Users lists the org's users: every page of them.
func (c *Client) Users(ctx context.Context) (UserList, error) {
	var l UserList
	var err error
	l.Document, err = c.everyPage(ctx, "/v1/users", "users", &l.Users)
	return l, err
}

// SetUserRole changes a user's role.
func (c *Client) SetUserRole(ctx context.Context, id, role string) (User, error) {
	var u User
	_, err := c.do(ctx, request{method: http.MethodPatch, path: "/v1/users/" + url.PathEscape(id),
		body: map[string]string{"role": role}}, &u)
	return u, err
}

// DeleteUser removes a user and their memberships.
func (c *Client) DeleteUser(ctx context.Context, id string) error {
	_, err := c.do(ctx, request{method: http.MethodDelete, path: "/v1/users/" + url.PathEscape(id)}, nil)
	return err
}

// Role is an org role, which tasks can be restricted to.
type Role struct {
	Document
	ID        string    `json:"id"`
	Slug      string    `json:"slug"`
	Name      string    `json:"name"`
	CreatedAt time.Time `json:"created_at"`
}

// RoleList is the org's roles, by slug.
type RoleList struct {
	Document
	Roles []Role `json:"roles"`
}

// CreateRole defines an org role; name is the slug when empty.
func (c *Client) CreateRole(ctx context.Context, slug, name string) (Role, error) {
	var r Role
	body := map[string]string{"slug": slug}
	if name != "" {
		body["name"] = name
	}
	_, err := c.do(ctx, request{method: http.MethodPost, path: "/v1/roles", body: body}, &r)
	return r, err
}

// Roles lists the org's roles.
func (c *Client) Roles(ctx context.Context) (RoleList, error) {
	var l RoleList
	_, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/roles"}, &l)
	return l, err
}

// DeleteRole removes an org role and its memberships.
func (c *Client) DeleteRole(ctx context.Context, slug string) error {
	_, err := c.do(ctx, request{method: http.MethodDelete, path: "/v1/roles/" + url.PathEscape(slug)}, nil)
	return err
}

// Members lists the users who are members of a role: every page of them.
func (c *Client) Members(ctx context.Context, slug string) (UserList, error) {
	var l UserList
	var err error
	l.Document, err = c.everyPage(ctx, "/v1/roles/"+url.PathEscape(slug)+"/members", "members", &l.Members)
	return l, err
}

// SetMember makes a user a member of a role (member true) or ends the
// membership; both are idempotent.
func (c *Client) SetMember(ctx context.Context, slug, userID string, member bool) error {
	method := http.MethodPut
	if !member {
		method = http.MethodDelete
	}
	_, err := c.do(ctx, request{method: method,
		path: "/v1/roles/" + url.PathEscape(slug) + "/members/" + url.PathEscape(userID)}, nil)
	return err
}
