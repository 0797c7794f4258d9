// Package apiclient is a client of Conveyor's HTTP API: one typed call per
// /v1 route, problem documents as *Error, and live streams followed across
// reconnects without showing an event twice.
package apiclient

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/conveyorhq/conveyor/internal/job"
)

// Config says where the API is and how to talk to it.
type Config struct {
	// URL is the API's base, such as http://localhost:8080.
	URL string
	// Token is sent as the bearer of every request: an API key or an
	// OpenID Connect token.
	Token string
	// Timeout bounds every request but streams; 0 means 30s.
	Timeout time.Duration
	// UserAgent names the caller in the API's logs.
	UserAgent string
	// Transport carries the requests; nil means http.DefaultTransport.
	Transport http.RoundTripper

	// ReconnectDelay is the first wait before a stream reconnects (0:
	// 250ms); it doubles while reconnects fail, up to ReconnectMaxDelay
	// (0: 2s, the server's own retry hint).
	ReconnectDelay, ReconnectMaxDelay time.Duration
	// ReconnectTries is how many reconnects in a row a stream makes
	// without receiving an event before it gives up (0: 20, about 35s).
	// A stream whose first dial fails is not retried: no API listens
	// there.
	ReconnectTries int
	// StreamIdleTimeout is how long a stream may stay silent, heartbeats
	// included, before it is taken for dead and reconnected (0: 60s).
	StreamIdleTimeout time.Duration
}

// Client calls the API. It is safe for concurrent use.
type Client struct {
	base   *url.URL
	cfg    Config
	http   *http.Client
	stream *http.Client
}

// New returns a client of the API at cfg.URL.
func New(cfg Config) (*Client, error) {
	u, err := url.Parse(strings.TrimRight(cfg.URL, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("API URL %q: want http(s)://host[:port]", cfg.URL)
	}
	cfg.Timeout = cmp.Or(cfg.Timeout, 30*time.Second)
	cfg.ReconnectDelay = cmp.Or(cfg.ReconnectDelay, 250*time.Millisecond)
	cfg.ReconnectMaxDelay = cmp.Or(cfg.ReconnectMaxDelay, 2*time.Second)
	cfg.ReconnectTries = cmp.Or(cfg.ReconnectTries, 20)
	cfg.StreamIdleTimeout = cmp.Or(cfg.StreamIdleTimeout, time.Minute)
	transport := cfg.Transport
	if transport == nil {
		transport = http.DefaultTransport
	}
	return &Client{
		base: u,
		cfg:  cfg,
		http: &http.Client{Timeout: cfg.Timeout, Transport: transport, CheckRedirect: sameMethod},
		// A stream lives as long as its caller wants; its silence is
		// bounded by StreamIdleTimeout instead.
		stream: &http.Client{Transport: transport, CheckRedirect: sameMethod},
	}, nil
}

// sameMethod follows a redirect only when the request goes on with its
// method (a read, or a 307 or 308): a 301, 302 or 303 turns a POST into a
// GET without its body, whose answer (a listing, say) would be taken for
// the write's. Such a redirect is answered as it came, an error that
// says where to.
func sameMethod(req *http.Request, via []*http.Request) error {
	if req.Method != via[0].Method {
		return http.ErrUseLastResponse
	}
	if len(via) >= 10 {
		return errors.New("stopped after 10 redirects")
	}
	return nil
}

// URL is the API's base URL.
func (c *Client) URL() string { return c.base.String() }

// Error is an answer of the API that is not a success, with the fields of
// its problem document (RFC 9457) when it sent one.
type Error struct {
	// Status is the HTTP status code.
	Status int
	Type   string
	Title  string
	Detail string
	// Field names the input at fault, for validation errors.
	Field    string
	Instance string
	// RetryAfter is the wait the API asked for (429), if any.
	RetryAfter time.Duration
	// Problems lists every mistake of a jobs file, each with its line,
	// when the API refused one (422).
	Problems job.Problems
}

// Error reads "detail (HTTP status)".
func (e *Error) Error() string {
	msg := cmp.Or(e.Detail, e.Title, http.StatusText(e.Status), "error")
	return fmt.Sprintf("%s (HTTP %d)", msg, e.Status)
}

// StatusOf is the HTTP status of an *Error in err's chain, or 0.
func StatusOf(err error) int {
	if e, ok := errors.AsType[*Error](err); ok {
		return e.Status
	}
	return 0
}

// Unreachable reports whether err is a failure to connect to the API at
// all (nothing listens there, or its name does not resolve), as opposed to
// an answer or a connection that broke.
func Unreachable(err error) bool {
	op, ok := errors.AsType[*net.OpError](err)
	return ok && op.Op == "dial"
}

// Document keeps the JSON the API answered, so that a caller can show it
// unchanged, fields this client does not know included.
type Document struct{ raw json.RawMessage }

// JSON is the document as the API sent it.
func (d Document) JSON() json.RawMessage { return d.raw }

func (d *Document) keep(b []byte) { d.raw = append(json.RawMessage(nil), b...) }

type keeper interface{ keep([]byte) }

// request is one call of the API.
type request struct {
	method string
	path   string
	query  url.Values
	header http.Header
	// body is sent as JSON, or as it is when a rawBody.
	body any
}

// do sends req and decodes a success into out (unless nil); it returns the
// status, so callers can tell a 201 from a 200 or a 202.
func (c *Client) do(ctx context.Context, req request, out any) (int, error) {
	resp, err := c.send(ctx, c.http, req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return resp.StatusCode, readError(resp)
	}
	if out == nil || resp.StatusCode == http.StatusNoContent {
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, nil
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, fmt.Errorf("%s %s: read answer: %w", req.method, req.path, err)
	}
	if err := json.Unmarshal(body, out); err != nil {
		return resp.StatusCode, fmt.Errorf("%s %s: decode answer: %w", req.method, req.path, err)
	}
	if k, ok := out.(keeper); ok {
		k.keep(body)
	}
	return resp.StatusCode, nil
}

// send builds and sends req; the caller closes the body.
func (c *Client) send(ctx context.Context, hc *http.Client, req request) (*http.Response, error) {
	// req.path is escaped (its segments by url.PathEscape): it goes to
	// RawPath as it is, so that a "%20" in a name is not escaped again.
	u := *c.base
	path, err := url.PathUnescape(req.path)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", req.method, req.path, err)
	}
	u.RawPath = c.base.EscapedPath() + req.path
	u.Path += path
	if len(req.query) > 0 {
		u.RawQuery = req.query.Encode()
	}
	var body io.Reader
	contentType := "application/json"
	if raw, ok := req.body.(rawBody); ok {
		body, contentType = bytes.NewReader(raw.data), raw.contentType
	} else if req.body != nil {
		b, err := bodyBytes(req.body)
		if err != nil {
			return nil, fmt.Errorf("%s %s: encode: %w", req.method, req.path, err)
		}
		body = bytes.NewReader(b)
	}
	r, err := http.NewRequestWithContext(ctx, req.method, u.String(), body)
	if err != nil {
		return nil, err
	}
	for k, vs := range req.header {
		r.Header[k] = vs
	}
	if body != nil {
		r.Header.Set("Content-Type", contentType)
	}
	if r.Header.Get("Accept") == "" {
		r.Header.Set("Accept", "application/json, application/problem+json")
	}
	if c.cfg.Token != "" {
		r.Header.Set("Authorization", "Bearer "+c.cfg.Token)
	}
	if c.cfg.UserAgent != "" {
		r.Header.Set("User-Agent", c.cfg.UserAgent)
	}
	resp, err := hc.Do(r)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, ctxErr
		}
		if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() && hc.Timeout > 0 {
			// Reached, maybe, but slow: not a network fault to look for.
			return nil, fmt.Errorf("the API at %s did not answer within %s", c.base, hc.Timeout)
		}
		return nil, fmt.Errorf("cannot reach the API at %s: %w", c.base, unwrapURLError(err))
	}
	return resp, nil
}

// rawBody is a request body sent as it is, of its own media type.
type rawBody struct {
	contentType string
	data        []byte
}

func bodyBytes(v any) ([]byte, error) {
	if raw, ok := v.(json.RawMessage); ok {
		return raw, nil
	}
	return json.Marshal(v)
}

// unwrapURLError drops the "Get "http://…": " that *url.Error repeats.
func unwrapURLError(err error) error {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		return ue.Err
	}
	return err
}

// readError turns an unsuccessful answer into an *Error, from its problem
// document when it is one, else from its status and the start of its body.
func readError(resp *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	e := &Error{Status: resp.StatusCode}
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
		e.RetryAfter = time.Duration(s) * time.Second
	}
	media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if media == "application/problem+json" || media == "application/json" {
		var p struct {
			Type     string       `json:"type"`
			Title    string       `json:"title"`
			Detail   string       `json:"detail"`
			Field    string       `json:"field"`
			Instance string       `json:"instance"`
			Errors   job.Problems `json:"errors"`
		}
		if json.Unmarshal(body, &p) == nil {
			e.Type, e.Title, e.Detail, e.Field, e.Instance = p.Type, p.Title, p.Detail, p.Field, p.Instance
			e.Problems = p.Errors
			return e
		}
	}
	e.Title = http.StatusText(resp.StatusCode)
	if loc, err := resp.Location(); err == nil && resp.StatusCode < 400 {
		e.Detail = fmt.Sprintf("the API redirects %s %s to %s: use the API's URL there",
			resp.Request.Method, resp.Request.URL.Path, loc)
		return e
	}
	if text := strings.TrimSpace(string(body)); text != "" && len(text) <= 200 && !strings.ContainsAny(text, "<>") {
		e.Detail = text
	}
	return e
}
