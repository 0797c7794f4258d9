package rabbitmq

import (
	"fmt"
	"net"
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

// dial connects to RabbitMQ with heartbeats, a connection name shown in the
// management UI, and bounded socket writes.
func dial(url, name string) (*amqp.Connection, error) {
	base := amqp.DefaultDial(30 * time.Second)
	conn, err := amqp.DialConfig(url, amqp.Config{
		Heartbeat:  heartbeat,
		Properties: amqp.Table{"connection_name": name},
		Dial: func(network, addr string) (net.Conn, error) {
			c, err := base(network, addr)
			if err != nil {
				return nil, err
			}
			return &deadlineConn{Conn: c}, nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	return conn, nil
}

// deadlineConn sets a write deadline before every write.
type deadlineConn struct{ net.Conn }

func (c *deadlineConn) Write(b []byte) (int, error) {
	if err := c.SetWriteDeadline(time.Now().Add(writeTimeout)); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}
