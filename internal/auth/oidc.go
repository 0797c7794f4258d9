// Verification of bearer tokens (JWTs) from an OpenID Connect issuer.

package auth

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
)

// discoveryRetry is how long after a failed discovery Verify answers with
// that failure instead of asking the issuer again, so that a down issuer is
// not hit by every request.
const discoveryRetry = time.Second

// Identity is who a verified token speaks for.
type Identity struct {
	// Subject is the token's "sub": the issuer's stable id of the user.
	Subject string
	// Email is the token's "email", if it has one. The issuer may not have
	// verified it: authorize on Subject, not on Email.
	Email string
}

// OIDC verifies ID and access tokens (JWTs) of one issuer for one audience.
// It is safe for concurrent use.
type OIDC struct {
	issuerURL string
	audience  string
	client    *http.Client
	now       func() time.Time

	verifier atomic.Pointer[oidc.IDTokenVerifier] // set once discovery succeeds

	// sem is a lock that a waiter can give up on when its context ends: it
	// is held while discovering, and guards failedAt and failure.
	sem      chan struct{}
	failedAt time.Time
	failure  error
}

// OIDCOption configures NewOIDC.
type OIDCOption func(*OIDC)

// WithHTTPClient makes the verifier fetch the discovery document and the
// keys with c. The default client times out after 10 seconds.
func WithHTTPClient(c *http.Client) OIDCOption {
	return func(o *OIDC) {
		if c != nil {
			o.client = c
		}
	}
}

// WithClock makes the verifier take the time from now, for tests: it
// decides whether a token has expired and when a failed discovery is tried
// again.
func WithClock(now func() time.Time) OIDCOption {
	return func(o *OIDC) {
		if now != nil {
			o.now = now
		}
	}
}

// NewOIDC returns a verifier of tokens from issuerURL for audience. It does
// not contact the issuer: discovery happens on the first Verify, so the
// service starts while the issuer is down. Once discovered, the issuer's
// signing keys are cached and fetched again when a token has an unknown
// key id, which is how issuers rotate keys.
func NewOIDC(issuerURL, audience string, opts ...OIDCOption) *OIDC {
	o := &OIDC{
		issuerURL: issuerURL,
		audience:  audience,
		// go-oidc fetches keys with no deadline of its own, and requests
		// wait on that fetch: a hung issuer must not hang them for ever.
		client: &http.Client{Timeout: 10 * time.Second},
		now:    time.Now,
		sem:    make(chan struct{}, 1),
	}
	for _, opt := range opts {
		opt(o)
	}
	return o
}

// Verify checks raw's signature, issuer, audience, expiry and not-before,
// and returns who it speaks for. Its errors never contain raw.
func (o *OIDC) Verify(ctx context.Context, raw string) (Identity, error) {
	v, err := o.discover(ctx)
	if err != nil {
		return Identity{}, err
	}
	tok, err := v.Verify(ctx, raw)
	if err != nil {
		return Identity{}, fmt.Errorf("auth: verify token: %w", err)
	}
	if tok.Subject == "" {
		return Identity{}, errors.New("auth: verify token: no subject")
	}
	var claims struct {
		Email string `json:"email"`
	}
	if err := tok.Claims(&claims); err != nil {
		return Identity{}, fmt.Errorf("auth: verify token: claims: %w", err)
	}
	return Identity{Subject: tok.Subject, Email: claims.Email}, nil
}

// discover returns the verifier, fetching the issuer's discovery document
// the first time and again after a failure, at most once per
// discoveryRetry.
func (o *OIDC) discover(ctx context.Context) (*oidc.IDTokenVerifier, error) {
	if v := o.verifier.Load(); v != nil {
		return v, nil
	}
	select {
	case o.sem <- struct{}{}:
		defer func() { <-o.sem }()
	case <-ctx.Done():
		return nil, fmt.Errorf("auth: discover issuer: %w", ctx.Err())
	}
	if v := o.verifier.Load(); v != nil {
		return v, nil // discovered while this caller waited
	}
	if o.failure != nil && o.now().Sub(o.failedAt) < discoveryRetry {
		return nil, o.failure
	}

	p, err := oidc.NewProvider(oidc.ClientContext(ctx, o.client), o.issuerURL)
	if err != nil {
		err = fmt.Errorf("auth: discover issuer %s: %w", o.issuerURL, err)
		// A caller that gave up says nothing about the issuer, so its
		// failure must not turn the next callers away.
		if ctx.Err() == nil {
			o.failedAt, o.failure = o.now(), err
		}
		return nil, err
	}
	// The provider's key set keeps the client from ClientContext and a
	// background context, so key fetches outlive the request that began
	// them.
	v := p.Verifier(&oidc.Config{ClientID: o.audience, Now: o.now})
	o.verifier.Store(v)
	return v, nil
}
