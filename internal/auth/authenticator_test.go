package auth

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// fakeDirectory holds keys in memory and counts lookups.
type fakeDirectory struct {
	mu      sync.Mutex
	keys    map[string]Record
	lookups int
	touched []uuid.UUID
}

func (d *fakeDirectory) KeyByPrefix(_ context.Context, prefix string) (Record, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.lookups++
	r, ok := d.keys[prefix]
	if !ok {
		return Record{}, ErrNotFound
	}
	return r, nil
}

func (d *fakeDirectory) UserBySubject(context.Context, string) (Record, error) {
	return Record{}, ErrNotFound
}

func (d *fakeDirectory) TouchKeys(_ context.Context, ids []uuid.UUID) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.touched = append(d.touched, ids...)
	return nil
}

func (d *fakeDirectory) add(role Role) (string, Record) {
	k := GenerateKey()
	r := Record{Principal: Principal{Kind: KindKey, ID: uuid.New(), Name: "k", OrgID: uuid.New(), Role: role}, SecretHash: k.Hash}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.keys == nil {
		d.keys = map[string]Record{}
	}
	d.keys[k.Prefix] = r
	return k.Token, r
}

func (d *fakeDirectory) update(token string, f func(*Record)) {
	prefix, _ := KeyPrefix(token)
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.keys[prefix]
	f(&r)
	d.keys[prefix] = r
}

func TestAuthenticateKeys(t *testing.T) {
	t.Parallel()
	dir := &fakeDirectory{}
	a := New(dir, Config{CacheTTL: time.Hour})
	token, rec := dir.add(Writer)
	ctx := context.Background()

	p, err := a.Authenticate(ctx, "Bearer "+token)
	require.NoError(t, err)
	require.Equal(t, rec.Principal, p)

	expired, _ := dir.add(Reader)
	past := time.Now().Add(-time.Minute)
	dir.update(expired, func(r *Record) { r.ExpiresAt = &past })
	revoked, _ := dir.add(Reader)
	dir.update(revoked, func(r *Record) { r.RevokedAt = &past })
	prefix, _ := KeyPrefix(token)
	wrongSecret := prefix + "_" + strings.Repeat("a", 52)

	for header, reason := range map[string]string{
		"":                               ReasonMissing,
		"Basic " + token:                 ReasonMalformed,
		"Bearer":                         ReasonMalformed,
		"Bearer nonsense":                ReasonMalformed,
		"Bearer cvk_short_secret":        ReasonMalformed,
		"Bearer " + wrongSecret:          ReasonUnknownKey,
		"Bearer " + GenerateKey().Token:  ReasonUnknownKey,
		"Bearer " + expired:              ReasonExpired,
		"Bearer " + revoked:              ReasonRevoked,
		"Bearer a.b.c":                   ReasonNoOIDC,
		"bearer " + token + "x":          ReasonMalformed,
		"Bearer " + token[:len(token)-1]: ReasonMalformed,
	} {
		_, err := a.Authenticate(ctx, header)
		require.Error(t, err, header)
		require.Equal(t, reason, ReasonOf(err), header)
		if len(header) > 20 {
			require.NotContains(t, err.Error(), header[7:], "the error never holds the token")
		}
	}
}

// A key revoked after it was used is refused once the cache's entry is
// older than the TTL, and not before: the TTL is the bound on revocation.
func TestRevocationTakesEffectWithinTheCacheTTL(t *testing.T) {
	t.Parallel()
	dir := &fakeDirectory{}
	const ttl = 50 * time.Millisecond
	a := New(dir, Config{CacheTTL: ttl})
	token, _ := dir.add(Admin)
	ctx := context.Background()
	_, err := a.Authenticate(ctx, "Bearer "+token)
	require.NoError(t, err)

	now := time.Now()
	dir.update(token, func(r *Record) { r.RevokedAt = &now })
	revokedAt := time.Now()
	for {
		_, err := a.Authenticate(ctx, "Bearer "+token)
		if err != nil {
			require.Equal(t, ReasonRevoked, ReasonOf(err))
			break
		}
		require.Less(t, time.Since(revokedAt), ttl+20*time.Millisecond, "still accepted past the TTL")
		time.Sleep(5 * time.Millisecond)
	}
}

// Many requests with one key ask the directory once per TTL, not once
// each; unknown prefixes are remembered too.
func TestLookupsAreCachedAndShared(t *testing.T) {
	t.Parallel()
	dir := &fakeDirectory{}
	a := New(dir, Config{CacheTTL: time.Hour})
	token, _ := dir.add(Reader)
	unknown := GenerateKey().Token
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(2)
		go func() { defer wg.Done(); _, _ = a.Authenticate(context.Background(), "Bearer "+token) }()
		go func() { defer wg.Done(); _, _ = a.Authenticate(context.Background(), "Bearer "+unknown) }()
	}
	wg.Wait()
	require.LessOrEqual(t, dir.lookups, 2*2, "one lookup per name, give or take a race at the start")
}

func TestLastUsedIsRecorded(t *testing.T) {
	t.Parallel()
	dir := &fakeDirectory{}
	a := New(dir, Config{CacheTTL: time.Hour, TouchEvery: 10 * time.Millisecond})
	token, rec := dir.add(Reader)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- a.Run(ctx) }()
	_, err := a.Authenticate(ctx, "Bearer "+token)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		dir.mu.Lock()
		defer dir.mu.Unlock()
		return len(dir.touched) == 1 && dir.touched[0] == rec.ID
	}, 5*time.Second, 5*time.Millisecond)
	cancel()
	require.NoError(t, <-done)
}

func TestRoles(t *testing.T) {
	t.Parallel()
	require.True(t, Admin.Allows(Writer))
	require.True(t, Writer.Allows(Reader))
	require.False(t, Reader.Allows(Writer))
	require.False(t, Role("").Allows(Reader))
	require.False(t, Role("root").Allows(Reader))
	_, err := ParseRole("owner")
	require.Error(t, err)
	p := Principal{Role: Writer, OrgRoles: []string{"finance"}}
	require.True(t, p.MayRestrictTo([]string{"finance"}))
	require.False(t, p.MayRestrictTo([]string{"finance", "hr"}))
	require.True(t, Principal{Role: Admin}.MayRestrictTo([]string{"hr"}))
}

// stuckDirectory answers no lookup until release is closed.
type stuckDirectory struct {
	fakeDirectory
	release chan struct{}
}

func (d *stuckDirectory) KeyByPrefix(ctx context.Context, prefix string) (Record, error) {
	<-d.release
	return d.fakeDirectory.KeyByPrefix(ctx, prefix)
}

// A caller waits for a lookup no longer than its context allows (the API
// bounds it by the request timeout), whether it asked the directory itself
// or shares another caller's lookup: a database slow to answer is a
// refusal the caller may retry, not a request that hangs.
func TestALookupIsBoundedByItsCallersContext(t *testing.T) {
	t.Parallel()
	dir := &stuckDirectory{release: make(chan struct{})}
	defer close(dir.release)
	a := New(dir, Config{CacheTTL: time.Hour})
	token, _ := dir.add(Reader)
	for range 2 { // the first asks, the second shares its lookup
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		done := make(chan error, 1)
		go func() { _, err := a.Authenticate(ctx, "Bearer "+token); done <- err }()
		select {
		case err := <-done:
			require.Error(t, err)
			require.Equal(t, ReasonLookup, ReasonOf(err))
		case <-time.After(5 * time.Second):
			t.Fatal("the lookup outlived its caller's context")
		}
		cancel()
	}
}

// Requests with made-up key prefixes, as many as anyone cares to send, keep
// the cache within its bound, and push no real key out of it: every one of
// the real key's requests would otherwise ask the database again.
func TestUnknownPrefixesNeitherGrowTheCacheNorEvictRealKeys(t *testing.T) {
	t.Parallel()
	dir := &fakeDirectory{}
	a := New(dir, Config{CacheTTL: time.Hour})
	token, _ := dir.add(Reader)
	ctx := context.Background()
	_, err := a.Authenticate(ctx, "Bearer "+token)
	require.NoError(t, err)

	for range maxEntries + 500 {
		_, err := a.Authenticate(ctx, "Bearer "+GenerateKey().Token)
		require.Equal(t, ReasonUnknownKey, ReasonOf(err))
	}
	require.LessOrEqual(t, a.keys.len(), maxEntries+1, "entries cached: the made-up prefixes within the bound, and the real key")

	dir.mu.Lock()
	before := dir.lookups
	dir.mu.Unlock()
	_, err = a.Authenticate(ctx, "Bearer "+token)
	require.NoError(t, err)
	dir.mu.Lock()
	defer dir.mu.Unlock()
	require.Equal(t, before, dir.lookups, "the real key was looked up again")
}

// blockingDirectory answers no lookup until the lookup's context ends, and
// counts those still waiting.
type blockingDirectory struct {
	fakeDirectory
	waiting atomic.Int64
}

func (d *blockingDirectory) KeyByPrefix(ctx context.Context, _ string) (Record, error) {
	d.waiting.Add(1)
	defer d.waiting.Add(-1)
	<-ctx.Done()
	return Record{}, ctx.Err()
}

// A lookup the database does not answer ends with its callers' deadline:
// without one, every made-up prefix sent while the database is slow would
// leave a goroutine waiting for a connection (or an answer) for ever, long
// after its request was answered.
func TestALookupEndsWithItsCallersDeadline(t *testing.T) {
	t.Parallel()
	dir := &blockingDirectory{}
	a := New(dir, Config{CacheTTL: time.Hour})
	for range 20 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		_, err := a.Authenticate(ctx, "Bearer "+GenerateKey().Token)
		cancel()
		require.Equal(t, ReasonLookup, ReasonOf(err))
	}
	require.Eventually(t, func() bool { return dir.waiting.Load() == 0 }, 5*time.Second, 5*time.Millisecond,
		"lookups still waiting after their callers left")
}

// Known answers without a lookup, and only for keys found before.
func TestKnownIsOnlyKeysFoundBefore(t *testing.T) {
	t.Parallel()
	dir := &fakeDirectory{}
	a := New(dir, Config{CacheTTL: time.Nanosecond})
	token, _ := dir.add(Reader)
	unknown := GenerateKey().Token
	require.False(t, a.Known("Bearer "+token), "never looked up")
	_, err := a.Authenticate(context.Background(), "Bearer "+token)
	require.NoError(t, err)
	_, err = a.Authenticate(context.Background(), "Bearer "+unknown)
	require.Error(t, err)
	before := dir.lookups
	require.True(t, a.Known("Bearer "+token), "found before, whatever the entry's age")
	require.False(t, a.Known("Bearer "+unknown))
	require.False(t, a.Known("Bearer not-a-key"))
	require.Equal(t, before, dir.lookups)
}
