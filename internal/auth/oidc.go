// Verification of bearer tokens (JWTs) from an OpenID Connect issuer.

package auth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/coreos/go-oidc/v3/oidc"
	"github.com/go-jose/go-jose/v4"
)

// discoveryRetry is how long after a failed discovery Verify answers with
// that failure instead of asking the issuer again, so that a down issuer is
// not hit by every request.
const discoveryRetry = time.Second

// clockSkew is how far in the future a token's iat (issued at) or nbf (not
// before) may lie and the token still be taken: the issuer's clock may run
// a little ahead of ours. A token from further ahead was minted by a clock
// that is wrong, or minted to be used later, and is refused.
const clockSkew = time.Minute

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

	discovery flight
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

// ErrIssuerUnavailable: the issuer could not be asked for its configuration,
// or for the keys a token names; the token was not judged.
var ErrIssuerUnavailable = errors.New("identity provider unavailable")

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
	}
	for _, opt := range opts {
		opt(o)
	}
	o.discovery.now = o.now
	return o
}

// Verify checks raw's signature, issuer, audience, expiry, issue time and
// not-before, and returns who it speaks for. Its errors never contain raw.
func (o *OIDC) Verify(ctx context.Context, raw string) (Identity, error) {
	v, err := o.discover(ctx)
	if err != nil {
		return Identity{}, err
	}
	// go-oidc keeps only the text of the key set's error: a fetch of the
	// keys that failed is handed back beside it.
	var fetchErr error
	tok, err := v.Verify(context.WithValue(ctx, keysFetchKey{}, &fetchErr), raw)
	if fetchErr != nil {
		return Identity{}, fmt.Errorf("auth: verify token: %w: %w", ErrIssuerUnavailable, fetchErr)
	}
	if err != nil {
		return Identity{}, fmt.Errorf("auth: verify token: %w", err)
	}
	if tok.Subject == "" {
		return Identity{}, errors.New("auth: verify token: no subject")
	}
	var claims struct {
		Email     string      `json:"email"`
		NotBefore json.Number `json:"nbf"`
	}
	if err := tok.Claims(&claims); err != nil {
		return Identity{}, fmt.Errorf("auth: verify token: claims: %w", err)
	}
	// go-oidc checks nbf with a leeway of five minutes and iat not at all.
	latest := o.now().Add(clockSkew)
	if tok.IssuedAt.After(latest) {
		return Identity{}, fmt.Errorf("auth: verify token: issued in the future (iat %s)", tok.IssuedAt.UTC().Format(time.RFC3339))
	}
	if claims.NotBefore != "" {
		nbf, err := claims.NotBefore.Float64()
		if err != nil {
			return Identity{}, fmt.Errorf("auth: verify token: nbf: %w", err)
		}
		if t := time.Unix(int64(nbf), 0); t.After(latest) {
			return Identity{}, fmt.Errorf("auth: verify token: not valid yet (nbf %s)", t.UTC().Format(time.RFC3339))
		}
	}
	return Identity{Subject: tok.Subject, Email: claims.Email}, nil
}

// discover returns the verifier, fetching the issuer's discovery document
// the first time and again after a failure, at most once per
// discoveryRetry. One discovery runs at a time, to its end whether or not
// its callers wait for it (each waits only as long as its context allows):
// an issuer slower than the requests' deadline is still discovered, and its
// failure always speaks of the issuer.
func (o *OIDC) discover(ctx context.Context) (*oidc.IDTokenVerifier, error) {
	if v := o.verifier.Load(); v != nil {
		return v, nil
	}
	err := o.discovery.wait(ctx, func() bool { return o.verifier.Load() != nil },
		func() error { return o.runDiscovery(ctx) })
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			err = fmt.Errorf("auth: discover issuer: %w: %w", ErrIssuerUnavailable, err)
		}
		return nil, err
	}
	return o.verifier.Load(), nil
}

// runDiscovery fetches the issuer's discovery document and stores the
// verifier it describes.
func (o *OIDC) runDiscovery(ctx context.Context) error {
	// The discovery outlives the request that began it: the others wait
	// on it.
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	p, err := oidc.NewProvider(oidc.ClientContext(dctx, o.client), o.issuerURL)
	var mismatch *oidc.IssuerMismatchError
	if errors.As(err, &mismatch) && strings.TrimSuffix(mismatch.Discovered, "/") == strings.TrimSuffix(o.issuerURL, "/") {
		// An issuer's identifier may end in a slash (Auth0's does) or not,
		// and OIDC_ISSUER_URL is written either way: the issuer is taken
		// under the identifier it publishes, which tokens' iss must then
		// match. Any other mismatch names another issuer.
		p, err = oidc.NewProvider(oidc.ClientContext(dctx, o.client), mismatch.Discovered)
	}
	if err != nil {
		return fmt.Errorf("auth: discover issuer %s: %w: %w", o.issuerURL, ErrIssuerUnavailable, err)
	}
	var meta struct {
		Issuer  string   `json:"issuer"`
		JWKSURL string   `json:"jwks_uri"`
		Algs    []string `json:"id_token_signing_alg_values_supported"`
	}
	if err := p.Claims(&meta); err != nil || meta.JWKSURL == "" {
		if err == nil {
			err = errors.New("no jwks_uri")
		}
		return fmt.Errorf("auth: discover issuer %s: %w: %w", o.issuerURL, ErrIssuerUnavailable, err)
	}
	algs := make([]jose.SignatureAlgorithm, 0, len(meta.Algs))
	for _, a := range meta.Algs {
		algs = append(algs, jose.SignatureAlgorithm(a))
	}
	if len(algs) == 0 {
		algs = []jose.SignatureAlgorithm{jose.RS256} // OpenID Connect's default
	}
	keys := &issuerKeys{url: meta.JWKSURL, client: o.client, algs: algs, now: o.now, fetching: flight{now: o.now}}
	v := oidc.NewVerifier(meta.Issuer, keys, &oidc.Config{ClientID: o.audience, Now: o.now, SupportedSigningAlgs: meta.Algs})
	o.verifier.Store(v)
	return nil
}

// unknownKeyEvery is how long a failed token of an unknown key id keeps
// other unknown key ids from making the key set fetch the issuer's keys.
const unknownKeyEvery = 5 * time.Second

// keysMaxAge is how long the issuer's keys are held before a token makes
// the key set fetch them again. An issuer that withdraws a key (it leaked)
// without rotating another in is heard within this time: tokens signed
// with the withdrawn key are refused from then on.
const keysMaxAge = 10 * time.Minute

// maxKeySetBytes bounds the issuer's key set document.
const maxKeySetBytes = 1 << 20

// issuerKeys is the issuer's key set, fetched by the verifier itself: a
// token of a key id it holds is checked against that key alone, and a bad
// signature is only a failure. (go-oidc's remote key set fetches the keys
// again after any signature that fails, so a forged token naming a
// published key id, sent again and again, made the API call the issuer at
// the rate it came.) A token of a key id it does not hold makes it fetch
// the keys, which is how a rotated-in key is picked up; after such a token
// failed, other unknown key ids are refused for unknownKeyEvery. A
// rotated-in key is picked up on its first use, unless a forged token came
// just before it. Keys held for keysMaxAge are fetched again beside the
// token that finds them so, which is checked against the keys held: no
// request waits for the issuer while its keys are known, and one that is
// down keeps the keys it last published.
type issuerKeys struct {
	url    string
	client *http.Client
	algs   []jose.SignatureAlgorithm
	now    func() time.Time

	// renewing says a fetch of keys grown old is under way.
	renewing atomic.Bool

	mu        sync.Mutex
	keys      jose.JSONWebKeySet
	fetched   int // fetches so far
	fetchedAt time.Time
	lastMiss  time.Time
	// fetching runs one fetch at a time for the tokens of key ids not
	// held, and answers its failure to the others for a while.
	fetching flight
}

// keysFetchKey is the context key under which OIDC.Verify leaves room for
// an error of fetching the issuer's keys.
type keysFetchKey struct{}

func (k *issuerKeys) VerifySignature(ctx context.Context, raw string) ([]byte, error) {
	jws, err := jose.ParseSignedCompact(raw, k.algs)
	if err != nil {
		return nil, fmt.Errorf("malformed token: %w", err)
	}
	if len(jws.Signatures) != 1 {
		return nil, errors.New("a token must carry one signature")
	}
	kid := jws.Signatures[0].Header.KeyID
	keys, seen, missed := k.lookup(kid)
	if len(keys) > 0 {
		k.renewIfOld(ctx, seen)
	}
	if len(keys) == 0 && !missed {
		if err := k.refresh(ctx, seen); err != nil {
			if p, ok := ctx.Value(keysFetchKey{}).(*error); ok {
				*p = err
			}
			return nil, err
		}
		if keys, _, _ = k.lookup(kid); len(keys) == 0 {
			k.mu.Lock()
			k.lastMiss = k.now()
			k.mu.Unlock()
		}
	}
	if len(keys) == 0 {
		return nil, errors.New("signed with a key id the issuer has not published")
	}
	return verifyWith(jws, keys)
}

// lookup returns the keys held of key id kid (every key when kid is
// empty), how many fetches they come from, and whether an unknown key id
// failed within unknownKeyEvery.
func (k *issuerKeys) lookup(kid string) (keys []jose.JSONWebKey, fetched int, missed bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	keys = k.keys.Keys
	if kid != "" {
		keys = k.keys.Key(kid)
	}
	return keys, k.fetched, !k.lastMiss.IsZero() && k.now().Sub(k.lastMiss) < unknownKeyEvery
}

// renewIfOld fetches the issuer's keys again, in the background, when
// those held are older than keysMaxAge; seen is the fetches they come from.
// One such fetch runs at a time. A failed one is answered as refresh
// answers it, so a down issuer is asked at most once per discoveryRetry.
func (k *issuerKeys) renewIfOld(ctx context.Context, seen int) {
	k.mu.Lock()
	old := k.now().Sub(k.fetchedAt) >= keysMaxAge
	k.mu.Unlock()
	if !old || !k.renewing.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer k.renewing.Store(false)
		_ = k.refresh(context.WithoutCancel(ctx), seen)
	}()
}

// verifyWith checks jws against each of keys, and returns its payload once
// one verifies it.
func verifyWith(jws *jose.JSONWebSignature, keys []jose.JSONWebKey) ([]byte, error) {
	for _, key := range keys {
		if payload, err := jws.Verify(&key); err == nil {
			return payload, nil
		}
	}
	return nil, errors.New("no published key verifies the signature")
}

// refresh fetches the issuer's keys, unless another caller has fetched them
// since this one read them (seen fetches then). It waits for the fetch
// only as long as ctx allows: the fetch itself runs to its end, bounded
// on its own, whether or not its caller waits for it, so that its failure
// always speaks of the issuer.
func (k *issuerKeys) refresh(ctx context.Context, seen int) error {
	err := k.fetching.wait(ctx, func() bool {
		k.mu.Lock()
		defer k.mu.Unlock()
		return k.fetched > seen
	}, func() error { return k.fetch(ctx) })
	if err != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		return fmt.Errorf("fetch keys: %w", err)
	}
	return err
}

// fetch reads the issuer's key set and holds it.
func (k *issuerKeys) fetch(ctx context.Context) error {
	// The fetch outlives the request that began it: the others wait on it.
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(fctx, http.MethodGet, k.url, nil)
	if err != nil {
		return fmt.Errorf("fetch keys: %w", err)
	}
	resp, err := k.client.Do(req)
	if err != nil {
		return fmt.Errorf("fetch keys: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch keys: %s answered %s", k.url, resp.Status)
	}
	var doc struct {
		Keys []json.RawMessage `json:"keys"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxKeySetBytes)).Decode(&doc); err != nil {
		return fmt.Errorf("fetch keys: %w", err)
	}
	// A key this verifier does not understand (a type or curve go-jose
	// lacks, an issuer's encryption key) is skipped, as RFC 7517 asks,
	// rather than failing the whole set and every token with it. So is a
	// key that is not public: a symmetric key is no issuer's to publish,
	// and would verify tokens anyone who read it signed.
	var set jose.JSONWebKeySet
	for _, raw := range doc.Keys {
		var key jose.JSONWebKey
		if err := key.UnmarshalJSON(raw); err != nil || !key.IsPublic() {
			continue
		}
		set.Keys = append(set.Keys, key)
	}
	k.mu.Lock()
	k.keys, k.fetched, k.fetchedAt = set, k.fetched+1, k.now()
	k.mu.Unlock()
	return nil
}
