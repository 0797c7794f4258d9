package auth_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

const (
	oidcAudience  = "conveyor-api"
	discoveryPath = "/.well-known/openid-configuration"
	jwksPath      = "/jwks"
)

type jwtClaims = map[string]any

func TestOIDCVerify(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	other := testenv.NewIssuer(t)
	v := auth.NewOIDC(iss.URL, oidcAudience)
	now := time.Now()

	tests := []struct {
		name    string
		raw     string
		want    auth.Identity
		wantErr string // a part of the error; empty when the token is good
	}{
		{
			name: "valid",
			raw:  iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience, "email": "alice@example.com"}),
			want: auth.Identity{Subject: "alice", Email: "alice@example.com"},
		},
		{
			name: "valid without email, audience in a list",
			raw:  iss.Token(t, jwtClaims{"sub": "bob", "aud": []string{"other-api", oidcAudience}}),
			want: auth.Identity{Subject: "bob"},
		},
		{
			name:    "expired",
			raw:     iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience, "exp": now.Add(-time.Minute)}),
			wantErr: "token is expired",
		},
		{
			name:    "not yet valid",
			raw:     iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience, "nbf": now.Add(time.Hour)}),
			wantErr: "nbf",
		},
		{
			name:    "not valid for another two minutes",
			raw:     iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience, "nbf": now.Add(2 * time.Minute)}),
			wantErr: "not valid yet",
		},
		{
			name: "not before a few seconds from now: the issuer's clock runs ahead",
			raw:  iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience, "nbf": now.Add(10 * time.Second), "iat": now.Add(10 * time.Second)}),
			want: auth.Identity{Subject: "alice"},
		},
		{
			name:    "issued in the future",
			raw:     iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience, "iat": now.Add(time.Hour), "exp": now.Add(2 * time.Hour)}),
			wantErr: "issued in the future",
		},
		{
			name:    "wrong audience",
			raw:     iss.Token(t, jwtClaims{"sub": "alice", "aud": "other-api"}),
			wantErr: "expected audience",
		},
		{
			name:    "no subject",
			raw:     iss.Token(t, jwtClaims{"aud": oidcAudience}),
			wantErr: "no subject",
		},
		{
			name:    "signed by another issuer's key",
			raw:     other.Token(t, jwtClaims{"iss": iss.URL, "sub": "alice", "aud": oidcAudience}),
			wantErr: "failed to verify signature",
		},
		{
			name:    "issued by another issuer",
			raw:     iss.Token(t, jwtClaims{"iss": other.URL, "sub": "alice", "aud": oidcAudience}),
			wantErr: "issued by a different provider",
		},
		{
			name:    "another issuer's token",
			raw:     other.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}),
			wantErr: "failed to verify signature",
		},
		{
			name:    "unsigned",
			raw:     unsignedJWT(t, iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})),
			wantErr: "malformed jwt",
		},
		{
			name:    "not a JWT",
			raw:     "this-is-not-a-jwt-but-is-long-enough-to-leak",
			wantErr: "malformed jwt",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := v.Verify(t.Context(), tt.raw)
			if tt.wantErr == "" {
				require.NoError(t, err)
				require.Equal(t, tt.want, got)
				return
			}
			require.ErrorContains(t, err, tt.wantErr)
			require.Zero(t, got)
			requireNoToken(t, err, tt.raw)
		})
	}
}

// After the issuer rotates its key, a token with the new key verifies
// because the unknown kid makes the verifier fetch the keys again, and a
// token with the old key then fails.
func TestOIDCKeyRotation(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr := newIssuerTransport()
	v := auth.NewOIDC(iss.URL, oidcAudience, auth.WithHTTPClient(&http.Client{Transport: tr}))
	ctx := t.Context()

	old := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err := v.Verify(ctx, old)
	require.NoError(t, err)
	require.Equal(t, 1, tr.hits(jwksPath))

	iss.Rotate(t)
	fresh := iss.Token(t, jwtClaims{"sub": "bob", "aud": oidcAudience})
	got, err := v.Verify(ctx, fresh)
	require.NoError(t, err)
	require.Equal(t, auth.Identity{Subject: "bob"}, got)
	require.Equal(t, 2, tr.hits(jwksPath), "unknown kid fetches the keys again")

	// go-oidc stores the keys it fetched just after it answers, so the
	// old key may still verify for a moment.
	require.Eventually(t, func() bool {
		_, err := v.Verify(ctx, old)
		return err != nil
	}, 5*time.Second, 10*time.Millisecond, "the old key still verifies")
	_, err = v.Verify(ctx, old)
	require.ErrorContains(t, err, "failed to verify signature")
	requireNoToken(t, err, old)

	fetches := tr.hits(jwksPath)
	_, err = v.Verify(ctx, fresh)
	require.NoError(t, err)
	require.Equal(t, fetches, tr.hits(jwksPath), "a known kid is served from the cache")
	require.Equal(t, 1, tr.hits(discoveryPath), "the provider is discovered once")
}

// An issuer that withdraws its key without a token of another key id
// coming is heard once the keys held grow old: the token that finds them
// so is checked against them, without waiting for the issuer, and tokens
// of the withdrawn key are refused once the keys are fetched again.
func TestOIDCAWithdrawnKeyIsRefusedOnceTheKeysHeldGrowOld(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr, clock, v := clockedVerifier(iss.URL)
	ctx := t.Context()
	old := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err := v.Verify(ctx, old)
	require.NoError(t, err)

	iss.Rotate(t) // the old key is no longer published
	clock.advance(9 * time.Minute)
	_, err = v.Verify(ctx, old)
	require.NoError(t, err, "keys held for less than their age are not fetched again")
	require.Equal(t, 1, tr.hits(jwksPath))

	clock.advance(2 * time.Minute)
	require.Eventually(t, func() bool {
		_, err := v.Verify(ctx, old)
		return err != nil
	}, 5*time.Second, 10*time.Millisecond, "the withdrawn key still verifies")
	// The withdrawn key id is now unknown: its first token asked the
	// issuer once more, as any unknown key id does, and no other does.
	fetches := tr.hits(jwksPath)
	require.LessOrEqual(t, fetches, 3)
	_, err = v.Verify(ctx, old)
	require.ErrorContains(t, err, "not published")
	requireNoToken(t, err, old)
	_, err = v.Verify(ctx, iss.Token(t, jwtClaims{"sub": "bob", "aud": oidcAudience}))
	require.NoError(t, err)
	require.Equal(t, fetches, tr.hits(jwksPath))
}

// While the issuer is down, keys grown old are still the keys it last
// published: their tokens verify, and the issuer is asked at most once a
// second, not by every token.
func TestOIDCOldKeysOfADownIssuerStillVerify(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr, clock, v := clockedVerifier(iss.URL)
	ctx := t.Context()
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err := v.Verify(ctx, raw)
	require.NoError(t, err)

	tr.down.Store(true)
	clock.advance(11 * time.Minute)
	for range 20 {
		_, err := v.Verify(ctx, raw)
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return tr.hits(jwksPath) == 2 }, 5*time.Second, 10*time.Millisecond)
	for range 20 {
		_, err := v.Verify(ctx, raw)
		require.NoError(t, err)
	}
	time.Sleep(50 * time.Millisecond) // a fetch wrongly begun would show
	require.Equal(t, 2, tr.hits(jwksPath), "a failed fetch is not repeated within a second")
}

// An issuer that cannot be reached does not stop the verifier being made;
// Verify then fails.
// Forged tokens naming our issuer, each signed with a key id it never
// published, cannot make the verifier fetch the issuer's keys at their
// rate: after one failed unknown key id, others wait unknownKeyEvery.
func TestOIDCForgedKeyIDsDoNotFloodTheIssuer(t *testing.T) {
	t.Parallel()
	iss, forger := testenv.NewIssuer(t), testenv.NewIssuer(t)
	tr, clock, v := clockedVerifier(iss.URL)
	ctx := t.Context()
	_, err := v.Verify(ctx, iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}))
	require.NoError(t, err)
	fetches := tr.hits(jwksPath)

	for range 50 {
		forger.Rotate(t) // a new key id each time
		_, err := v.Verify(ctx, forger.Token(t, jwtClaims{"sub": "mallory", "aud": oidcAudience, "iss": iss.URL}))
		require.Error(t, err)
	}
	require.LessOrEqual(t, tr.hits(jwksPath), fetches+1, "one fetch for the first forged key id, none after")
	_, err = v.Verify(ctx, iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}))
	require.NoError(t, err, "a known key id still verifies")

	clock.advance(6 * time.Second)
	iss.Rotate(t)
	_, err = v.Verify(ctx, iss.Token(t, jwtClaims{"sub": "bob", "aud": oidcAudience}))
	require.NoError(t, err, "a rotated-in key is taken once the window has passed")
}

// Forged tokens naming a key id the issuer did publish, with a signature
// that key did not make, fail against the key the verifier holds: they
// cannot make it fetch the issuer's keys at all.
func TestOIDCForgedSignaturesOfAKnownKeyIDDoNotFetchTheKeys(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr := newIssuerTransport()
	v := auth.NewOIDC(iss.URL, oidcAudience, auth.WithHTTPClient(&http.Client{Transport: tr}))
	ctx := t.Context()
	good := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err := v.Verify(ctx, good)
	require.NoError(t, err)
	fetches := tr.hits(jwksPath)

	// The same header and claims, the signature of another key.
	header, _, _ := strings.Cut(good, ".")
	forger := testenv.NewIssuer(t)
	forged := forger.Token(t, jwtClaims{"sub": "mallory", "aud": oidcAudience, "iss": iss.URL})
	_, rest, _ := strings.Cut(forged, ".")
	forged = header + "." + rest
	for range 50 {
		_, err := v.Verify(ctx, forged)
		require.ErrorContains(t, err, "failed to verify signature")
	}
	require.Equal(t, fetches, tr.hits(jwksPath), "no fetch for a known key id")
	_, err = v.Verify(ctx, good)
	require.NoError(t, err)
}

func TestOIDCUnreachableIssuer(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close() // its port now refuses connections

	v := auth.NewOIDC(srv.URL, oidcAudience)
	raw := testenv.NewIssuer(t).Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err := v.Verify(t.Context(), raw)
	require.ErrorContains(t, err, "discover issuer")
	require.ErrorContains(t, err, "connection refused")
	requireNoToken(t, err, raw)
}

// A token signed with a key the issuer cannot serve, because it is down
// as the token arrives, meets the issuer's unavailability, not a bad token:
// the API answers 503 and keeps the person's open streams, instead of 401.
// Once the issuer is back, and the failure no longer stands for it, the
// same token verifies.
func TestOIDCKeysTheIssuerCannotServeAreItsUnavailability(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr, clock, v := clockedVerifier(iss.URL)
	_, err := v.Verify(t.Context(), iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}))
	require.NoError(t, err)

	iss.Rotate(t)
	tr.down.Store(true)
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err = v.Verify(t.Context(), raw)
	require.ErrorIs(t, err, auth.ErrIssuerUnavailable)
	requireNoToken(t, err, raw)

	tr.down.Store(false)
	clock.advance(time.Second)
	got, err := v.Verify(t.Context(), raw)
	require.NoError(t, err)
	require.Equal(t, "alice", got.Subject)
}

// While the issuer cannot serve its keys, tokens of key ids the verifier
// does not hold (a rotation it has not seen, or forgeries naming our
// issuer) meet that failure without asking the issuer again, until a
// second has passed: a down issuer is not fetched from by every request,
// nor do the requests queue up behind one fetch each. Once the issuer is
// back and the second has passed, the rotated-in key is taken.
func TestOIDCKeysAFailedFetchIsNotRepeatedByEveryToken(t *testing.T) {
	t.Parallel()
	iss, forger := testenv.NewIssuer(t), testenv.NewIssuer(t)
	tr, clock, v := clockedVerifier(iss.URL)
	ctx := t.Context()
	_, err := v.Verify(ctx, iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}))
	require.NoError(t, err)
	fetches := tr.hits(jwksPath)

	iss.Rotate(t)
	tr.down.Store(true)
	rotated := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	for range 50 {
		forger.Rotate(t) // a new key id each time
		_, err := v.Verify(ctx, forger.Token(t, jwtClaims{"sub": "mallory", "aud": oidcAudience, "iss": iss.URL}))
		require.ErrorIs(t, err, auth.ErrIssuerUnavailable)
		_, err = v.Verify(ctx, rotated)
		require.ErrorIs(t, err, auth.ErrIssuerUnavailable, "the token was not judged: the issuer could not say")
	}
	require.LessOrEqual(t, tr.hits(jwksPath), fetches+1, "one fetch while the issuer is down, not one per token")

	tr.down.Store(false)
	clock.advance(discoveryRetryWithin)
	_, err = v.Verify(ctx, rotated)
	require.ErrorIs(t, err, auth.ErrIssuerUnavailable, "the last failure, within the retry interval")
	clock.advance(time.Second)
	got, err := v.Verify(ctx, rotated)
	require.NoError(t, err)
	require.Equal(t, "alice", got.Subject)
}

// Discovery fails while the issuer answers 503, is not tried again within a
// second, and succeeds once the issuer is back; then the provider is reused.
func TestOIDCDiscoveryRetry(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr := newIssuerTransport()
	tr.down.Store(true)
	clock := newFakeClock()
	v := auth.NewOIDC(iss.URL, oidcAudience,
		auth.WithHTTPClient(&http.Client{Transport: tr}), auth.WithClock(clock.now))
	require.Zero(t, tr.hits(discoveryPath), "made without asking the issuer")

	ctx := t.Context()
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})
	_, err := v.Verify(ctx, raw)
	require.ErrorContains(t, err, "503")
	requireNoToken(t, err, raw)
	require.Equal(t, 1, tr.hits(discoveryPath))

	tr.down.Store(false)
	clock.advance(discoveryRetryWithin)
	_, err = v.Verify(ctx, raw)
	require.ErrorContains(t, err, "503", "the last failure, within the retry interval")
	require.Equal(t, 1, tr.hits(discoveryPath))

	clock.advance(time.Second)
	got, err := v.Verify(ctx, raw)
	require.NoError(t, err)
	require.Equal(t, auth.Identity{Subject: "alice"}, got)
	require.Equal(t, 2, tr.hits(discoveryPath))

	clock.advance(time.Minute)
	_, err = v.Verify(ctx, raw)
	require.NoError(t, err)
	require.Equal(t, 2, tr.hits(discoveryPath), "the provider is reused")
}

// discoveryRetryWithin is a time less than the verifier's retry interval.
const discoveryRetryWithin = 900 * time.Millisecond

// A caller whose context ends while discovering does not make the next
// caller wait for the retry interval: the discovery it began runs to its
// end, and serves the next caller.
func TestOIDCCanceledDiscoveryNotRemembered(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	ctx, cancel := context.WithCancel(t.Context())
	tr := newIssuerTransport()
	tr.before = func(*http.Request) { cancel() } // the caller gives up mid-request
	v := auth.NewOIDC(iss.URL, oidcAudience,
		auth.WithHTTPClient(&http.Client{Transport: tr}), auth.WithClock(newFakeClock().now))
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})

	_, err := v.Verify(ctx, raw)
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 1, tr.hits(discoveryPath))

	_, err = v.Verify(t.Context(), raw)
	require.NoError(t, err)
	require.Equal(t, 1, tr.hits(discoveryPath))
}

// The verifier's clock, not the wall clock, decides expiry.
func TestOIDCClock(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	clock := newFakeClock()
	v := auth.NewOIDC(iss.URL, oidcAudience, auth.WithClock(clock.now))
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}) // expires in an hour

	_, err := v.Verify(t.Context(), raw)
	require.NoError(t, err)
	clock.advance(2 * time.Hour)
	_, err = v.Verify(t.Context(), raw)
	require.ErrorContains(t, err, "token is expired")
}

// Many first callers at once share one discovery, and all verify.
func TestOIDCConcurrentFirstUse(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr := newIssuerTransport()
	v := auth.NewOIDC(iss.URL, oidcAudience, auth.WithHTTPClient(&http.Client{Transport: tr}))
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})

	const n = 32
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			_, err := v.Verify(t.Context(), raw)
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, 1, tr.hits(discoveryPath))
}

// requireNoToken fails t if err's message holds raw or any long part of it.
func requireNoToken(t *testing.T, err error, raw string) {
	t.Helper()
	msg := err.Error()
	for _, part := range append(strings.Split(raw, "."), raw) {
		if len(part) >= 8 && strings.Contains(msg, part) {
			t.Fatalf("error contains the token: %s", msg)
		}
	}
}

// unsignedJWT returns raw's claims as a JWT with "alg": "none" and no
// signature.
func unsignedJWT(t *testing.T, raw string) string {
	t.Helper()
	parts := strings.Split(raw, ".")
	require.Len(t, parts, 3)
	header := base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","typ":"JWT"}`))
	return header + "." + parts[1] + "."
}

// issuerTransport counts requests by path and, while down, answers each
// with a 503, as an issuer behind a load balancer does while it is out.
type issuerTransport struct {
	down   atomic.Bool
	before func(*http.Request) // if set, called first on each request

	mu     sync.Mutex
	counts map[string]int
}

func newIssuerTransport() *issuerTransport { return &issuerTransport{counts: map[string]int{}} }

func (tr *issuerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	tr.mu.Lock()
	tr.counts[r.URL.Path]++
	tr.mu.Unlock()
	if tr.before != nil {
		tr.before(r)
	}
	if tr.down.Load() {
		return &http.Response{
			Status:     "503 Service Unavailable",
			StatusCode: http.StatusServiceUnavailable,
			Proto:      "HTTP/1.1",
			ProtoMajor: 1,
			ProtoMinor: 1,
			Header:     http.Header{"Content-Type": {"text/plain"}},
			Body:       io.NopCloser(strings.NewReader("down for maintenance")),
			Request:    r,
		}, nil
	}
	return http.DefaultTransport.RoundTrip(r)
}

func (tr *issuerTransport) hits(path string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.counts[path]
}

// clockedVerifier is a verifier of the issuer at url that fetches through
// a counting transport and reads the time from a fake clock.
func clockedVerifier(url string) (*issuerTransport, *fakeClock, *auth.OIDC) {
	tr, clock := newIssuerTransport(), newFakeClock()
	return tr, clock, auth.NewOIDC(url, oidcAudience, auth.WithHTTPClient(&http.Client{Transport: tr}), auth.WithClock(clock.now))
}

// fakeClock is a time that moves only when a test advances it.
type fakeClock struct{ unixNano atomic.Int64 }

func newFakeClock() *fakeClock {
	c := &fakeClock{}
	c.unixNano.Store(time.Now().UnixNano())
	return c
}

func (c *fakeClock) now() time.Time          { return time.Unix(0, c.unixNano.Load()) }
func (c *fakeClock) advance(d time.Duration) { c.unixNano.Add(int64(d)) }

// A request waits for a hung key set only as long as its own deadline
// allows, whether it started the fetch or waits on another's: the issuer
// hanging must not hold requests past their timeout (the fetch's own bound
// is 10 seconds).
func TestOIDCAHungKeySetEndsWithTheCallersDeadline(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	tr := newIssuerTransport()
	tr.before = func(r *http.Request) {
		if r.URL.Path == jwksPath {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
	}
	v := auth.NewOIDC(iss.URL, oidcAudience, auth.WithHTTPClient(&http.Client{Transport: tr}))
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})

	var wg sync.WaitGroup
	for range 3 { // the one that fetches and two that wait on it
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			start := time.Now()
			_, err := v.Verify(ctx, raw)
			require.ErrorIs(t, err, auth.ErrIssuerUnavailable)
			require.Less(t, time.Since(start), 2*time.Second, "the caller's deadline, not the fetch's")
			requireNoToken(t, err, raw)
		})
	}
	wg.Wait()
}

// An issuer slower to answer its discovery document than the requests'
// deadline is still discovered: the discovery runs to its end while the
// callers give up on it, so a later request verifies instead of every one
// starting a discovery it cannot finish.
func TestOIDCASlowDiscoveryOutlivesItsCallers(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	tr := newIssuerTransport()
	tr.before = func(r *http.Request) {
		if r.URL.Path == discoveryPath {
			time.Sleep(300 * time.Millisecond)
		}
	}
	v := auth.NewOIDC(iss.URL, oidcAudience, auth.WithHTTPClient(&http.Client{Transport: tr}))
	raw := iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience})

	var err error
	for range 10 {
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		_, err = v.Verify(ctx, raw)
		cancel()
		if err == nil {
			break
		}
		require.ErrorIs(t, err, auth.ErrIssuerUnavailable)
		requireNoToken(t, err, raw)
	}
	require.NoError(t, err, "discovered once the issuer answered")
	require.Equal(t, 1, tr.hits(discoveryPath))
}

// A key set that also holds keys the verifier does not understand (a key
// type or curve go-jose lacks, such as an X25519 key for encryption) still
// verifies tokens of the keys it does understand, as RFC 7517 asks: one
// such key used to fail the whole set, and every person's token with it
// (503s, for as long as the issuer published that key). A symmetric key
// is never a published one, and verifies nothing.
func TestOIDCKeysTheVerifierDoesNotUnderstandAreSkipped(t *testing.T) {
	t.Parallel()
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	signing := jose.JSONWebKey{Key: priv, KeyID: "rsa-1", Algorithm: string(jose.RS256), Use: "sig"}
	pub, err := json.Marshal(signing.Public())
	require.NoError(t, err)
	secret := []byte("a-secret-an-issuer-should-never-publish")
	extra := []string{
		`{"kty":"OKP","crv":"X25519","kid":"enc-1","use":"enc","x":"hSDwCYkwp1R0i33ctD73Wg2_Og0mOBr066SpjqqbTmo"}`,
		`{"kty":"EC","crv":"secp256k1","kid":"k1","x":"3r9IwB0QY0DuPhDcqNRp4JwzNCzNsC4CGWNxQzDoRmc","y":"YCu0Vd7S3STAjxQz1AAtsIqbQe9ldkmOJTxP9RKuCZs"}`,
		`{"kty":"oct","kid":"hmac-1","k":"` + base64.RawURLEncoding.EncodeToString(secret) + `"}`,
	}
	var url string
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+discoveryPath, func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{"issuer": url, "jwks_uri": url + jwksPath,
			"id_token_signing_alg_values_supported": []string{"RS256", "HS256"}})
	})
	mux.HandleFunc("GET "+jwksPath, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"keys":[`+strings.Join(extra, ",")+`,`+string(pub)+`]}`)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	url = srv.URL
	v := auth.NewOIDC(url, oidcAudience)

	sign := func(key any, alg jose.SignatureAlgorithm, kid string) string {
		claims, err := json.Marshal(jwtClaims{"iss": url, "sub": "alice", "aud": oidcAudience, "exp": time.Now().Add(time.Hour).Unix()})
		require.NoError(t, err)
		signer, err := jose.NewSigner(jose.SigningKey{Algorithm: alg, Key: jose.JSONWebKey{Key: key, KeyID: kid}}, nil)
		require.NoError(t, err)
		obj, err := signer.Sign(claims)
		require.NoError(t, err)
		raw, err := obj.CompactSerialize()
		require.NoError(t, err)
		return raw
	}
	got, err := v.Verify(t.Context(), sign(priv, jose.RS256, "rsa-1"))
	require.NoError(t, err)
	require.Equal(t, "alice", got.Subject)

	_, err = v.Verify(t.Context(), sign(secret, jose.HS256, "hmac-1"))
	require.Error(t, err)
	require.NotErrorIs(t, err, auth.ErrIssuerUnavailable)
}

// OIDC_ISSUER_URL that differs from the issuer's identifier by a trailing
// slash alone (Auth0's ends in one; this issuer's does not) names the
// issuer: its tokens verify, their iss checked against the identifier the
// issuer publishes. Every token was refused as if the issuer were down.
func TestOIDCIssuerURLWithATrailingSlash(t *testing.T) {
	t.Parallel()
	iss := testenv.NewIssuer(t)
	v := auth.NewOIDC(iss.URL+"/", oidcAudience)
	got, err := v.Verify(t.Context(), iss.Token(t, jwtClaims{"sub": "alice", "aud": oidcAudience}))
	require.NoError(t, err)
	require.Equal(t, "alice", got.Subject)
	_, err = v.Verify(t.Context(), iss.Token(t, jwtClaims{"iss": iss.URL + "/", "sub": "alice", "aud": oidcAudience}))
	require.ErrorContains(t, err, "issued by a different provider")
	require.NotErrorIs(t, err, auth.ErrIssuerUnavailable)
}
