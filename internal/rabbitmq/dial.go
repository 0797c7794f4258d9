package rabbitmq

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	heartbeat = 10 * time.Second
	// writeTimeout bounds every socket write. amqp091-go writes without a
	// deadline while holding the channel's lock, and its shutdown takes
	// that lock before it closes the socket: a peer that stops reading (a
	// partition, a proxy whose upstream died) would freeze the publisher
	// for good. With a deadline the write fails and the connection closes.
	writeTimeout = 15 * time.Second
)

// ParseURLs reads AMQP_URL: one AMQP URL, or the URLs of several nodes of a
// cluster separated by commas. Each must parse as an AMQP URL; blanks
// around the commas are ignored.
func ParseURLs(list string) ([]string, error) {
	var urls []string
	for u := range strings.SplitSeq(list, ",") {
		u = strings.TrimSpace(u)
		if u == "" {
			return nil, errors.New("empty URL in the list")
		}
		if _, err := amqp.ParseURI(u); err != nil {
			// A URL may hold a password: the error names the URL's
			// position, not the URL, which url.Error quotes whole.
			if ue := (*url.Error)(nil); errors.As(err, &ue) {
				err = fmt.Errorf("%w (a reserved character in the user name or password must be percent-encoded)", ue.Err)
			}
			return nil, fmt.Errorf("URL %d of %d: %w", len(urls)+1, strings.Count(list, ",")+1, err)
		}
		urls = append(urls, u)
	}
	return urls, nil
}

// dials counts the dials of this process. Each dial starts with the next
// node of the list: a reconnect, or another connection of the process,
// tries another node first, so connections spread over a cluster and one
// after a node's loss does not start with the lost node again. The
// first dial takes the first node: processes given the list in different
// orders start on different nodes.
var dials atomic.Uint64

// rotation is the order in which the dial numbered n tries the nodes.
func rotation(urls []string, n uint64) []string {
	start := int(n % uint64(len(urls)))
	return append(append(make([]string, 0, len(urls)), urls[start:]...), urls[:start]...)
}

// dial connects to one of the nodes in list (see ParseURLs), trying them in
// turn, with heartbeats, a connection name shown in the management UI, and
// bounded socket writes. When no node answers it returns the last error.
func dial(list, name string) (*amqp.Connection, error) {
	conn, _, err := dialSocket(list, name)
	return conn, err
}

// dialSocket is dial that also returns the connection's socket, for an
// owner that must be able to drop the connection without the broker's
// answer (see Publisher.Close).
func dialSocket(list, name string) (*amqp.Connection, net.Conn, error) {
	urls, err := ParseURLs(list)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to RabbitMQ: AMQP_URL: %w", err)
	}
	for _, url := range rotation(urls, dials.Add(1)-1) {
		var (
			conn *amqp.Connection
			sock net.Conn
		)
		if conn, sock, err = dialOne(url, name); err == nil {
			return conn, sock, nil
		}
	}
	what := "connect to RabbitMQ"
	if len(urls) > 1 {
		what = fmt.Sprintf("connect to RabbitMQ (none of %d nodes answered)", len(urls))
	}
	if f := dialFailure(err); f != "" {
		return nil, nil, fmt.Errorf("%s: %s: %w", what, f, err)
	}
	return nil, nil, fmt.Errorf("%s: %w", what, err)
}

// dialFailure says in a few words what a failed dial met, so that its log
// sends the operator to the right place — the network, the credentials, the
// vhost or the certificates — and not to the network for every failure.
// It is empty when the error says no more than itself.
func dialFailure(err error) string {
	var (
		ae     *amqp.Error
		verify *tls.CertificateVerificationError
		record tls.RecordHeaderError
		alert  tls.AlertError
		netErr net.Error
	)
	switch {
	case errors.As(err, &ae) && ae.Code == amqp.AccessRefused:
		return "the broker refused the login (check the user name and password in AMQP_URL)"
	case errors.As(err, &ae) && ae.Code == amqp.NotAllowed:
		return "the broker refused the vhost (check that AMQP_URL's vhost exists and the user may use it)"
	case errors.As(err, &ae):
		return "the broker closed the connection"
	case errors.As(err, &verify), errors.As(err, &record), errors.As(err, &alert):
		return "TLS handshake failed"
	case errors.As(err, &netErr):
		return "broker unreachable"
	}
	return ""
}

func dialOne(url, name string) (*amqp.Connection, net.Conn, error) {
	base := amqp.DefaultDial(30 * time.Second)
	var sock net.Conn
	conn, err := amqp.DialConfig(url, amqp.Config{
		Heartbeat:  heartbeat,
		Properties: amqp.Table{"connection_name": name},
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := base(network, addr)
			if err != nil {
				return nil, err
			}
			sock = &deadlineConn{Conn: c}
			return sock, nil
		},
	})
	if err != nil {
		return nil, nil, err
	}
	return conn, sock, nil
}

// deadlineConn sets a write deadline before every write.
type deadlineConn struct{ net.Conn }

func (c *deadlineConn) Write(b []byte) (int, error) {
	if err := c.SetWriteDeadline(time.Now().Add(writeTimeout)); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}
