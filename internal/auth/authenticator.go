package auth

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	lru "github.com/hashicorp/golang-lru/v2"
	"golang.org/x/sync/singleflight"
)

// ErrNotFound is what a Directory answers for a key or user it does not
// have.
var ErrNotFound = errors.New("not found")

// Record is a key or a user as the Directory stores it.
type Record struct {
	Principal
	// SecretHash is a key's stored hash.
	SecretHash []byte
	ExpiresAt  *time.Time
	RevokedAt  *time.Time
}

// Directory looks principals up across orgs.
type Directory interface {
	// KeyByPrefix returns the key with the prefix, revoked or not.
	KeyByPrefix(ctx context.Context, prefix string) (Record, error)
	// UserBySubject returns the user whose external_id is subject.
	UserBySubject(ctx context.Context, subject string) (Record, error)
	// TouchKeys records that the keys were just used.
	TouchKeys(ctx context.Context, ids []uuid.UUID) error
}

// Verifier checks an OpenID Connect token (OIDC is the one in use).
type Verifier interface {
	Verify(ctx context.Context, raw string) (Identity, error)
}

// Config tunes an Authenticator.
type Config struct {
	// CacheTTL is how long a looked-up key or user is trusted before it is
	// read again: a revoked key is refused on every instance within it.
	CacheTTL time.Duration
	// OIDC verifies people's tokens; nil refuses every JWT.
	OIDC Verifier
	// TouchEvery is how often last-used times are written.
	TouchEvery time.Duration
	Log        *slog.Logger
}

// Authenticator turns bearer tokens into principals. It is safe for
// concurrent use; Run writes the keys' last-used times.
type Authenticator struct {
	dir   Directory
	cfg   Config
	keys  *cache
	users *cache

	mu   sync.Mutex
	used map[uuid.UUID]struct{}
}

// New returns an Authenticator over dir.
func New(dir Directory, cfg Config) *Authenticator {
	if cfg.TouchEvery <= 0 {
		cfg.TouchEvery = time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Authenticator{dir: dir, cfg: cfg,
		keys:  newCache(cfg.CacheTTL, dir.KeyByPrefix),
		users: newCache(cfg.CacheTTL, dir.UserBySubject),
		used:  map[uuid.UUID]struct{}{},
	}
}

// Authenticate checks the value of an Authorization header.
func (a *Authenticator) Authenticate(ctx context.Context, header string) (Principal, error) {
	if header == "" {
		return Principal{}, fail(ReasonMissing, "authentication required: send Authorization: Bearer <API key or token>", nil)
	}
	scheme, token, ok := strings.Cut(header, " ")
	token = strings.TrimSpace(token)
	if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
		return Principal{}, fail(ReasonMalformed, "the Authorization header must read Bearer <API key or token>", nil)
	}
	if strings.HasPrefix(token, keyMark) {
		return a.key(ctx, token)
	}
	if strings.Count(token, ".") == 2 {
		return a.jwt(ctx, token)
	}
	return Principal{}, fail(ReasonMalformed, "the bearer token is neither an API key nor a JWT", nil)
}

func (a *Authenticator) key(ctx context.Context, token string) (Principal, error) {
	prefix, ok := KeyPrefix(token)
	if !ok {
		return Principal{}, fail(ReasonMalformed, "malformed API key", nil)
	}
	rec, err := a.keys.get(ctx, prefix)
	switch {
	case errors.Is(err, ErrNotFound):
		return Principal{}, fail(ReasonUnknownKey, "unknown API key "+prefix, nil)
	case err != nil:
		return Principal{}, fail(ReasonLookup, "could not check the API key; try again", err)
	case !keyMatches(token, rec.SecretHash):
		return Principal{}, fail(ReasonUnknownKey, "unknown API key "+prefix, nil)
	case rec.RevokedAt != nil:
		return Principal{}, fail(ReasonRevoked, "API key "+prefix+" was revoked", nil)
	case rec.ExpiresAt != nil && !time.Now().Before(*rec.ExpiresAt):
		return Principal{}, fail(ReasonExpired, "API key "+prefix+" expired", nil)
	}
	a.mu.Lock()
	a.used[rec.ID] = struct{}{}
	a.mu.Unlock()
	return rec.Principal, nil
}

func (a *Authenticator) jwt(ctx context.Context, token string) (Principal, error) {
	if a.cfg.OIDC == nil {
		return Principal{}, fail(ReasonNoOIDC, "tokens of an identity provider are not accepted here (OIDC_ISSUER_URL is not set); use an API key", nil)
	}
	id, err := a.cfg.OIDC.Verify(ctx, token)
	if errors.Is(err, ErrIssuerUnavailable) {
		return Principal{}, fail(ReasonLookup, "the identity provider could not be reached; try again", err)
	}
	if err != nil {
		return Principal{}, fail(ReasonInvalidJWT, "invalid token: "+err.Error(), err)
	}
	rec, err := a.users.get(ctx, id.Subject)
	switch {
	case errors.Is(err, ErrNotFound):
		return Principal{}, fail(ReasonUnknownUser, "no user for this token's subject: ask an admin of your org to add you", nil)
	case err != nil:
		return Principal{}, fail(ReasonLookup, "could not look the user up; try again", err)
	}
	return rec.Principal, nil
}

// Run writes the last-used times of the keys used since the last write,
// every TouchEvery, until ctx is done.
func (a *Authenticator) Run(ctx context.Context) error {
	t := time.NewTicker(a.cfg.TouchEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		a.mu.Lock()
		used := a.used
		a.used = map[uuid.UUID]struct{}{}
		a.mu.Unlock()
		if len(used) == 0 {
			continue
		}
		ids := make([]uuid.UUID, 0, len(used))
		for id := range used {
			ids = append(ids, id)
		}
		if err := a.dir.TouchKeys(ctx, ids); err != nil && ctx.Err() == nil {
			a.cfg.Log.WarnContext(ctx, "could not record when API keys were last used", "keys", len(ids), "err", err)
		}
	}
}

// cache keeps lookups, found or not, for ttl; concurrent misses of one name
// share one lookup. Names found and names not found are kept apart, each
// within maxEntries, least recently used out first: anyone can send made-up
// key prefixes, and those must push out only other made-up ones, never the
// real keys, whose every request would then ask the database.
type cache struct {
	ttl  time.Duration
	load func(context.Context, string) (Record, error)

	group   singleflight.Group
	mu      sync.Mutex // orders a name's move between found and missing
	found   *lru.Cache[string, entry]
	missing *lru.Cache[string, entry]
}

type entry struct {
	rec Record
	err error
	at  time.Time
}

// maxEntries bounds each half of a cache.
const maxEntries = 10_000

func newCache(ttl time.Duration, load func(context.Context, string) (Record, error)) *cache {
	// lru.New fails only for a size below 1.
	found, _ := lru.New[string, entry](maxEntries)
	missing, _ := lru.New[string, entry](maxEntries)
	return &cache{ttl: ttl, load: load, found: found, missing: missing}
}

func (c *cache) lookup(name string) (entry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.found.Get(name); ok {
		return e, true
	}
	return c.missing.Get(name)
}

func (c *cache) get(ctx context.Context, name string) (Record, error) {
	now := time.Now()
	e, ok := c.lookup(name)
	if ok && now.Sub(e.at) < c.ttl {
		return e.rec, e.err
	}
	// The lookup runs to its end whatever its callers do (it is shared),
	// but each caller waits for it only as long as its context allows.
	// It keeps the first caller's deadline, though: without one, each
	// made-up prefix sent while the database is slow would leave a
	// goroutine waiting for it for ever.
	ch := c.group.DoChan(name, func() (any, error) {
		lctx, cancel := context.WithoutCancel(ctx), context.CancelFunc(func() {})
		if deadline, ok := ctx.Deadline(); ok {
			lctx, cancel = context.WithDeadline(lctx, deadline)
		}
		defer cancel()
		rec, err := c.load(lctx, name)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return nil, err // not cached: the next request asks again
		}
		// The time of the lookup's start: the entry never outlives the
		// ttl counted from when the database was asked.
		e := entry{rec: rec, err: err, at: now}
		c.mu.Lock()
		defer c.mu.Unlock()
		if err != nil {
			c.found.Remove(name)
			c.missing.Add(name, e)
		} else {
			c.missing.Remove(name)
			c.found.Add(name, e)
		}
		return e, nil
	})
	select {
	case res := <-ch:
		if res.Err != nil {
			return Record{}, res.Err
		}
		e = res.Val.(entry)
		return e.rec, e.err
	case <-ctx.Done():
		return Record{}, ctx.Err()
	}
}

func (c *cache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.found.Len() + c.missing.Len()
}

// Known says whether header holds an API key whose prefix this instance
// has found before, at any age, without asking the database: a caller
// refusing a flood of made-up credentials lets such keys through to
// Authenticate, since made-up prefixes are never among them.
func (a *Authenticator) Known(header string) bool {
	scheme, token, ok := strings.Cut(header, " ")
	token = strings.TrimSpace(token)
	if !ok || !strings.EqualFold(scheme, "Bearer") || !strings.HasPrefix(token, keyMark) {
		return false
	}
	prefix, ok := KeyPrefix(token)
	if !ok {
		return false
	}
	a.keys.mu.Lock()
	defer a.keys.mu.Unlock()
	return a.keys.found.Contains(prefix)
}
