package auth

import (
	"encoding/json"
	"time"

	"github.com/google/uuid"
)

// Key is an API key as its org's admins see it: never its secret.
type Key struct {
	ID         uuid.UUID
	Name       string
	Role       Role
	Prefix     string
	OrgRoles   []string
	CreatedBy  json.RawMessage
	CreatedAt  time.Time
	ExpiresAt  *time.Time
	LastUsedAt *time.Time
	RevokedAt  *time.Time
}

// KeyInput asks for a new key.
type KeyInput struct {
	Name      string
	Role      Role
	OrgRoles  []string
	ExpiresAt *time.Time
}

// User is a person of an org.
type User struct {
	ID         uuid.UUID
	ExternalID string
	Email      string
	Role       Role
	OrgRoles   []string
	CreatedAt  time.Time
}

// UserInput adds a user, or (with ExternalID empty) changes one's role.
type UserInput struct {
	ExternalID string
	Email      string
	Role       Role
}

// OrgRole is a role an org defines for visibility.
type OrgRole struct {
	ID        uuid.UUID
	Slug      string
	Name      string
	CreatedAt time.Time
}
